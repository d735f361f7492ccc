"""The embedded engine's KV cache: one pre-allocated row per running request."""

import functools
import itertools

import torch

from RL2.native.decode_kernels import RowGroups


class SlotKVCache:
    """HF attention layers call `update` once per layer and attend over what it returns. Buffers grow by doubling and
    are zero-initialised: SDPA adds the mask to the scores, and NaN + -inf is still NaN. Values are in the model's
    dtype, as SDPA's kernels multiply them with the probabilities; keys in float32 (upcasting bf16 keys at every step
    cost more than the attention itself), except with `keys_in_model_dtype`, for the C decode kernels, which widen them
    as they score them. A decode step's `row_groups` (rows holding copies of one prompt) read a shared prompt once."""

    def __init__(self, max_rows: int, keys_in_model_dtype: bool = False):
        self.max_rows = max_rows
        self.keys_in_model_dtype = keys_in_model_dtype
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows = slice(0, 0)
        self._start = 0
        self._prefix_row: int | None = None
        self._positions: torch.Tensor | None = None
        self._row_index: torch.Tensor | None = None
        self._length = 0
        # Requests running or waiting: the rows grow straight to this many (up to `max_rows`), not by doublings.
        self.expected_rows = 0
        self.share_prompt_reads = True  # False: every row reads all of its own positions (the same results)
        self._shared: dict[int, tuple[int, int]] = {}  # row -> (copy id, positions it holds of that copy)
        self._copy_ids = itertools.count()
        self.row_groups: RowGroups | None = None  # of the bound decode step; None: no two rows share

    def bind_prefill(self, rows: slice, start: int, width: int, prefix_row: int | None = None) -> None:
        """The next forward writes positions start..start+width-1 of `rows` and reads from 0. With `prefix_row`,
        each layer first copies positions 0..start-1 from that row into all of `rows` (a shared prompt prefix)."""
        self._rows, self._start, self._prefix_row = rows, start, prefix_row
        self._positions, self._length = None, start + width
        for row in range(rows.start, rows.stop):
            self._shared.pop(row, None)
        if prefix_row is not None:
            self.share_prompt(range(rows.start, rows.stop), start)

    def bind_decode(self, positions: torch.Tensor, length: int) -> None:
        """The next forward writes one token per row 0..n-1 at `positions` and reads `length`."""
        self._rows, self._positions, self._length = slice(0, len(positions)), positions, length
        self._row_index = torch.arange(len(positions), device=positions.device)
        self.row_groups = self._row_groups(len(positions)) if self.share_prompt_reads else None

    def share_prompt(self, rows, length: int) -> None:
        """`rows` hold the same keys and values at positions 0..length-1 (copies of one prompt's)."""
        copy_id = next(self._copy_ids)
        for row in rows:
            self._shared[row] = (copy_id, length)

    def _row_groups(self, n_rows: int) -> RowGroups | None:
        """Rows 0..n_rows-1 by the prompt copy they hold (a row holding none is a group of its own)."""
        groups: dict[tuple, list[int]] = {}
        for row in range(n_rows):
            groups.setdefault(self._shared.get(row, ("alone", row)), []).append(row)
        if len(groups) == n_rows:
            return None
        members = list(groups.values())
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64)
        return RowGroups(order=as_tensor([row for rows in members for row in rows]),
                         starts=as_tensor([0, *itertools.accumulate(len(rows) for rows in members)]),
                         shared=as_tensor([key[1] if key[0] != "alone" else 0 for key in groups]))

    def buffers(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's whole key and value buffers `[rows, H_kv, L, D]`, with room for the bound
        forward; `key` and `value` (`[rows, H_kv, T, D]`) give a new layer's head count, dim, dtypes."""
        if layer_idx == len(self.keys):
            dtype = key.dtype if self.keys_in_model_dtype else torch.float32
            self.keys.append(key.new_zeros(0, key.shape[1], 0, key.shape[3], dtype=dtype))
            self.values.append(value.new_zeros(0, value.shape[1], 0, value.shape[3], dtype=value.dtype))
        keys = self._reserve(self.keys, layer_idx, self._rows.stop, self._length)
        return keys, self._reserve(self.values, layer_idx, self._rows.stop, self._length)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """HF cache API: store this layer's new keys/values, return the ones to attend over."""
        keys, values = self.buffers(layer_idx, key, value)
        rows, start = self._rows, self._start
        key, value = key.to(keys.dtype), value.to(values.dtype)
        if self._positions is None:
            if self._prefix_row is not None:
                keys[rows, :, :start] = keys[self._prefix_row, :, :start]
                values[rows, :, :start] = values[self._prefix_row, :, :start]
            keys[rows, :, start : start + key.shape[2]] = key
            values[rows, :, start : start + value.shape[2]] = value
        else:
            keys[self._row_index, :, self._positions] = key[:, :, 0]
            values[self._row_index, :, self._positions] = value[:, :, 0]
        return keys[rows, :, : self._length], values[rows, :, : self._length]

    def _reserve(self, buffers: list[torch.Tensor], layer_idx: int, min_rows: int, min_length: int) -> torch.Tensor:
        old = buffers[layer_idx]
        rows, length = old.shape[0], old.shape[2]
        if min_rows <= rows and min_length <= length:
            return old
        # Each dimension grows only when it is short: growing one should not double the other.
        new_rows = rows if min_rows <= rows else min(self.max_rows, max(min_rows, 2 * rows, self.expected_rows))
        new_length = length if min_length <= length else max(min_length, 2 * length, 128)
        new = old.new_zeros(new_rows, old.shape[1], new_length, old.shape[3])
        new[:rows, :, :length] = old
        buffers[layer_idx] = new
        return new

    @torch.inference_mode()
    def copy_rows(self, sources: torch.Tensor | list[int], first_row: int, length: int) -> None:
        """Fill rows first_row.. with the first `length` positions of rows `sources` (all layers); they then share
        the prompt copies their sources did."""
        for buffers in (self.keys, self.values):
            for layer_idx in range(len(buffers)):
                buffer = self._reserve(buffers, layer_idx, first_row + len(sources), length)
                buffer[first_row : first_row + len(sources), :, :length] = buffer[sources, :, :length]
        copied = {first_row + i: self._shared.get(int(source)) for i, source in enumerate(sources)}
        for dst, shared in copied.items():
            self._shared.pop(dst, None)
            if shared is not None:
                self._shared[dst] = shared

    def clear(self) -> None:
        self.keys, self.values = [], []
        self._shared, self.row_groups = {}, None
