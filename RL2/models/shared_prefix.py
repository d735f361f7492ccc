"""Compute a prefix that consecutive packed sequences share once (docs/cpu.md, "Shared prefixes"): each run's prefix,
then each sequence's remainder, its branch; packed token t reads its output at compressed token `source[t]`. A position
is shared only while inputs and labels agree (`runs_with_shared_prefix`): the last shared label is the run's."""

from dataclasses import dataclass, field

import torch

from RL2.batch import MicroBatch
from RL2.models.attention import log_backend_once, sdpa, tokens_major_cat
from RL2.native.prefix_attention import prefix_attention, usable
from RL2.utils.shared_prefixes import runs_with_shared_prefix


@dataclass
class Block:
    """One run of sequences in the compressed row: from `start`, `prefix` shared tokens (all of a sequence that
    shares with no other), then branches of lengths `branches`, maybe empty (a sequence that is all prefix)."""

    start: int
    prefix: int
    branches: list[int] = field(default_factory=list)


@dataclass
class SharedPrefixRow:
    """`input_ids`, `labels`, `position_ids` `[1, T_c]` of the compressed row; `source` `[T]` long, where each packed
    token is in it; `blocks` the runs, in order, tiling it."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    source: torch.Tensor
    blocks: list[Block]
    _masks: dict = field(default_factory=dict, repr=False)
    _runs: torch.Tensor | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    @classmethod
    def build(cls, mb: MicroBatch) -> "SharedPrefixRow | None":
        """The compressed form of `mb`'s row, or None when no run of its sequences shares a prefix."""
        inputs, labels = mb.input_ids[0].tolist(), mb.labels[0].tolist()
        bounds = mb.cu_seqlens.tolist()
        # A sequence as its full tokens: positions agree up to t while tokens 0..t+1 do.
        sequences = [inputs[a:b] + labels[b - 1 : b] for a, b in zip(bounds[:-1], bounds[1:])]
        runs = runs_with_shared_prefix(sequences, set(mb.unit_starts))
        if all(len(run) == 1 for run, _ in runs):
            return None
        keep, source, blocks = [], [], []  # the packed tokens the compressed row stores; where each packed one is
        for run, shared in runs:
            block = Block(start=len(keep), prefix=shared)
            keep.extend(range(bounds[run[0]], bounds[run[0]] + shared))
            for sequence in run:
                start, end = bounds[sequence] + shared, bounds[sequence + 1]
                source.extend(range(block.start, block.start + shared))
                source.extend(range(len(keep), len(keep) + end - start))
                block.branches.append(end - start)
                keep.extend(range(start, end))
            blocks.append(block)
        device = mb.input_ids.device
        keep = torch.tensor(keep, dtype=torch.long, device=device)
        return cls(mb.input_ids[:, keep], mb.labels[:, keep], mb.position_ids[:, keep],
                   torch.tensor(source, dtype=torch.long, device=device), blocks)

    def compress_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """`[1, T]` 0/1 over the packed row -> `[1, T_c]`: 1 where any token stored there has 1."""
        out = torch.zeros(1, self.length, dtype=mask.dtype, device=mask.device)
        out[0, self.source[mask[0] > 0]] = 1
        return out

    def expand(self, values: torch.Tensor) -> torch.Tensor:
        """`[1, T_c, ...]` per compressed token -> `[1, T, ...]` per packed token, differentiably."""
        return values[:, self.source]

    def attention(self, query, key, value, scaling: float) -> torch.Tensor:
        """query `[1, H, T_c, D]`, key/value `[1, H_kv, T_c, D]` -> `[1, T_c, H, D]`; causal, branch after prefix."""
        if usable(query, key, value):
            log_backend_once("shared-prefix", "prefix_attention.c", query.device, query.dtype)
            return prefix_attention(query, key, value, self.runs(), scaling)
        log_backend_once("shared-prefix", "sdpa", query.device, query.dtype)
        # One split of each input (as `attention._per_sequence`), not a slice per branch and its gradient's row.
        sizes = [size for block in self.blocks for size in (block.prefix, *block.branches)]
        pieces = zip(*(x.split(sizes, dim=2) for x in (query, key, value)))  # (q, k, v) of each, in order
        outputs = []
        for block in self.blocks:
            prefix_q, prefix_k, prefix_v = next(pieces)
            outputs.append(sdpa(prefix_q, prefix_k, prefix_v, scaling))
            for length in block.branches:
                branch_q, branch_k, branch_v = next(pieces)
                if not length:
                    continue
                keys, values = torch.cat([prefix_k, branch_k], dim=2), torch.cat([prefix_v, branch_v], dim=2)
                mask = self._branch_mask(length, block.prefix, query.device)
                outputs.append(sdpa(branch_q, keys, values, scaling, mask))
        return tokens_major_cat(outputs)

    def runs(self) -> torch.Tensor:
        """`[3, T_c]` int64, the keys each token sees: its block's prefix (prefix_start..prefix_end - 1;
        none for a prefix token) and its own tokens from own_start (its prefix's or branch's first) to itself."""
        if self._runs is None:
            runs = []  # (prefix_start, prefix_end, own_start) of each token
            for block in self.blocks:
                runs += [(block.start, block.start, block.start)] * block.prefix
                first = block.start + block.prefix
                for length in block.branches:
                    runs += [(block.start, block.start + block.prefix, first)] * length
                    first += length
            self._runs = torch.tensor(runs, dtype=torch.long).reshape(-1, 3).T.contiguous()
        return self._runs

    def _branch_mask(self, length: int, prefix: int, device: torch.device) -> torch.Tensor:
        # Query i of a branch sits at prefix + i: it sees every prefix key and branch keys 0..i.
        key = (length, prefix, device)
        if key not in self._masks:
            self._masks[key] = torch.ones(length, prefix + length, dtype=torch.bool, device=device).tril(prefix)
        return self._masks[key]
