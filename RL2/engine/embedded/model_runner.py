"""Batched prefill and decode forwards of a Hugging Face causal LM over a slot KV cache: a request's tokens sit at
positions 0..n-1 of its row, so requests of any length share a batch without left padding and a finished request frees
its row without touching the others. Only the sampled positions go through the output projection. Llama-family models
run through `llama_forward.py`; any other through its unmodified HF decoder, given a cache with HF's `update`, per-row
`position_ids` and a 4D boolean mask, with `decode_attention` and `PackedLinear` layers during those forwards."""

import functools
import inspect
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from RL2.engine.embedded.kv_cache import SlotKVCache
from RL2.engine.embedded.llama_forward import LlamaForward, attend_one_token, attention_bias, llama_forward_supported
from RL2.engine.embedded.packed_linear import (
    ConcatLinear,
    OneDNNLinear,
    PackedLinear,
    PanelLinear,
    onednn_packing_works,
    panel_kernels_for,
)
from RL2.models.attention import softcapped_attention
from RL2.native.decode_kernels import load_decode_kernels
from RL2.utils.shared_prefixes import common_prefix_length

# A prompt prefix shared by a whole prefill batch (a chat template's system prompt) is computed once when it is at
# least this long; shorter ones cost less than the extra forward.
MIN_SHARED_PREFIX = 16

DECODE_ATTN = "rl2_decode"


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of one new token per row (query `[rows, H, 1, D]`, key/value `[rows, H_kv, L, D]` from `SlotKVCache`,
    attention_mask boolean `[rows, 1, 1, L]`) by `attend_one_token` (see there why); longer queries go to SDPA."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    softcap = kwargs.pop("softcap", None)
    if softcap:  # Gemma 2 caps its scores, which SDPA cannot
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:  # an additive mask: 0 where a key is visible
            mask = mask == 0
        return softcapped_attention(query, key, value, scale, softcap, mask).transpose(1, 2), None
    if query.shape[2] != 1 or attention_mask is None or attention_mask.dtype != torch.bool:
        key = key.to(query.dtype)  # the cache holds keys in float32
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    bias = attention_bias(attention_mask.view(len(query), -1))
    out = attend_one_token(query[:, :, 0], key, value, bias, scale)
    return out[:, None], None  # [rows, q=1, H, D], as HF's attention functions return


AttentionInterface.register(DECODE_ATTN, decode_attention)


@torch.no_grad()
def own_parameter_memory(model: torch.nn.Module) -> None:
    """Copy CPU parameters that still live in a file mapping (`from_pretrained` maps safetensors files) into the
    process's own memory. Weight updates write into the parameters in place, and the first write to a privately
    mapped file page copies it page by page, a page fault each, far slower than one copy done here at start."""
    try:
        with open("/proc/self/maps") as maps:  # Linux; elsewhere nothing is copied
            lines = [line.split() for line in maps]
    except OSError:
        return
    mappings = [tuple(int(address, 16) for address in fields[0].split("-"))
                for fields in lines if len(fields) >= 6 and fields[5].startswith("/")]
    for param in model.parameters():
        address = param.data_ptr()
        if param.device.type == "cpu" and any(start <= address < end for start, end in mappings):
            param.data = param.data.clone()


def _logits_are_the_head_of_the_decoder(model: torch.nn.Module) -> bool:
    """Whether logits = output projection of the decoder's last hidden states (not so with
    Gemma's softcapping, Cohere's logit scale or Granite's logits scaling)."""
    config = model.config
    scales = [getattr(config, key, None) for key in ("final_logit_softcapping", "logit_scale", "logits_scaling")]
    return all(s in (None, 1.0) for s in scales) and model.get_output_embeddings() is not None


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The name under which `model_class.forward` takes a KV cache (read once per class): transformers 5.24 renamed
    `past_key_values` to `cache` (the old name warns on every call, and goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class ModelRunner:
    """Owns an HF causal LM in eval mode and its slot KV cache of `max_rows` rows; runs prefill and decode
    forwards. For `owns_model` see `EmbeddedEngine` (it applies where the runner's own Llama forward runs)."""

    def __init__(self, model: torch.nn.Module, max_rows: int, owns_model: bool = False):
        self.model = model
        self.device = next(model.parameters()).device
        own_parameter_memory(model)
        # Released parameters not loaded since, by id: (the parameter, its shape; None where only a kernel holds it).
        self.unwritten: dict[int, tuple[torch.nn.Parameter, torch.Size | None]] = {}
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.panel_kernels = panel_kernels_for(linears[0]) if linears else None
        self.packable = bool(linears) and (self.panel_kernels is not None or onednn_packing_works(linears[0]))
        self.kernels: list[PackedLinear] = []  # refreshed after load_weights
        self.packed: dict[torch.nn.Module, PackedLinear] = {}  # for the HF modules' own forwards
        self.llama: LlamaForward | None = None
        self.head = None
        head_is_output = _logits_are_the_head_of_the_decoder(model)
        if head_is_output and llama_forward_supported(model):  # the engine's own forward; HF's modules are not run
            self.llama = LlamaForward(model, self._kernel)
            self.head = self._kernel([model.get_output_embeddings()])
        else:
            self.packed = {m: self._kernel([m]) for m in linears} if self.packable else {}
            if head_is_output:
                output = model.get_output_embeddings()
                self.head = self.packed.get(output) or output
        # The C sampler where the C decode kernels build (any model on the CPU; `sample_next_tokens`).
        self.sampling_kernels = load_decode_kernels() if self.device.type == "cpu" else None
        decodes_with_kernels = self.llama is not None and self.llama.decode_kernels is not None
        self.cache = SlotKVCache(max_rows, keys_in_model_dtype=decodes_with_kernels)
        # Parameters held only by a packed kernel, by name: (kernel, layer index in it, "weight" or "bias", shape).
        self.packed_only: dict[str, tuple[PanelLinear, int, str, torch.Size]] = {}
        if owns_model and self.llama is not None:  # HF's modules might read a weight's shape
            self._keep_packed_only()

    def _keep_packed_only(self) -> None:
        """Drop the linear layers' own weights where a panel kernel holds them; a parameter the model
        uses elsewhere too (an output projection tied to the embedding) keeps its own copy."""
        uses = Counter(id(param) for _, param in self.model.named_parameters(remove_duplicate=False))
        names = {id(param): name for name, param in self.model.named_parameters()}
        for kernel in self.kernels:
            params = [p for linear in kernel.linears for p in (linear.weight, linear.bias) if p is not None]
            if not isinstance(kernel, PanelLinear) or any(uses[id(p)] > 1 for p in params):
                continue
            for index, linear in enumerate(kernel.linears):
                for part in ("weight", "bias"):
                    param = getattr(linear, part)
                    if param is not None:
                        self.packed_only[names[id(param)]] = (kernel, index, part, param.shape)
            kernel.keep_packed_only()

    def _kernel(self, linears: list[torch.nn.Linear]) -> PackedLinear:
        if self.panel_kernels is not None:
            kernel = PanelLinear(linears, self.panel_kernels)
        else:
            kernel = OneDNNLinear(linears) if self.packable else ConcatLinear(linears)
        self.kernels.append(kernel)
        return kernel

    @contextmanager
    def _engine_kernels(self) -> Iterator[None]:
        """The engine's decode attention and packed linears, for the duration of one forward. Scoped rather than set
        once: the engine may be handed a model its caller also uses."""
        config = self.model.config
        attention = config._attn_implementation  # HF reads it at every forward
        own = {linear: linear.__dict__.get("forward") for linear in self.packed}  # e.g. accelerate's hooks
        config._attn_implementation = DECODE_ATTN
        for linear, packed in self.packed.items():
            linear.forward = packed  # an instance attribute: found before the class's forward
        try:
            yield
        finally:
            config._attn_implementation = attention
            for linear, forward in own.items():
                if forward is None:
                    del linear.forward
                else:
                    linear.forward = forward

    @torch.inference_mode()
    def prefill(self, first_row: int, prompts: list[list[int]]) -> torch.Tensor:
        """Forward whole prompts into rows first_row.. and return each one's last logits [n, vocab]. Identical prompts
        (a GRPO group's) are forwarded once and their rows copied; then a prefix that all distinct prompts share (at
        least MIN_SHARED_PREFIX tokens) is forwarded once, into the first row, and copied to the other rows."""
        distinct = list(dict.fromkeys(tuple(p) for p in prompts))
        if len(distinct) < len(prompts):
            which = {prompt: i for i, prompt in enumerate(distinct)}
            index = torch.tensor([which[tuple(p)] for p in prompts], device=self.device)
            logits = self.prefill(first_row, [list(p) for p in distinct])
            self.cache.copy_rows(first_row + index, first_row, max(len(p) for p in distinct))
            rows_of: dict[int, list[int]] = {}
            for row, i in enumerate(index.tolist()):
                rows_of.setdefault(i, []).append(first_row + row)
            for i, rows in rows_of.items():
                if len(rows) > 1:
                    self.cache.share_prompt(rows, len(distinct[i]))
            return logits[index]
        rows = slice(first_row, first_row + len(prompts))
        shared = min(common_prefix_length(prompts), min(len(p) for p in prompts) - 1)
        if len(prompts) == 1 or shared < MIN_SHARED_PREFIX:
            return self._extend(rows, prompts, start=0)
        self._extend(slice(first_row, first_row + 1), [prompts[0][:shared]], start=0, logits=False)
        return self._extend(rows, [p[shared:] for p in prompts], start=shared, prefix_row=first_row)

    def _extend(self, rows: slice, chunks: list[list[int]], start: int, prefix_row: int | None = None,
                logits: bool = True) -> torch.Tensor | None:
        """Forward `chunks` at positions start.. of `rows`, after the cached positions 0..start-1. Chunks are
        right-padded: a padded query position still sees its row's real tokens, so no attention row is fully masked, and
        its keys lie past the row's length where later tokens overwrite them before anything reads them."""
        lengths = torch.tensor([len(c) for c in chunks], device=self.device)
        width = int(lengths.max())
        input_ids = torch.zeros(len(chunks), width, dtype=torch.long, device=self.device)
        for i, chunk in enumerate(chunks):
            input_ids[i, : len(chunk)] = torch.tensor(chunk)
        query = torch.arange(width, device=self.device)[None, :, None]
        key = torch.arange(start + width, device=self.device)[None, None, :] - start
        mask = (key < 0) | ((key <= query) & (key < lengths[:, None, None]))
        self.cache.bind_prefill(rows, start, width, prefix_row)
        positions = (start + query[:, :, 0]).expand(len(chunks), width)
        keep = (lengths - 1)[:, None] if logits else None
        if self.llama is not None:
            hidden = self.llama.extend(input_ids, positions, self.cache, mask[:, None], keep)
            return None if hidden is None else self.head(hidden)
        return self._forward(input_ids, positions, mask[:, None], keep)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of rows 0..n-1 at its own position; returns logits [n, vocab]."""
        positions = torch.tensor(positions, device=self.device)
        length = int(positions.max()) + 1
        self.cache.bind_decode(positions, length)
        if self.llama is not None:
            return self.head(self.llama.decode(torch.tensor(tokens, device=self.device), positions, self.cache))
        mask = torch.arange(length, device=self.device)[None, :] <= positions[:, None]
        input_ids = torch.tensor(tokens, device=self.device)[:, None]
        return self._forward(input_ids, positions[:, None], mask[:, None, None], torch.zeros_like(positions)[:, None])

    def _forward(self, input_ids, position_ids, mask, keep: torch.Tensor | None) -> torch.Tensor | None:
        """Logits [rows, vocab] at position `keep[row, 0]` of each row's chunk (None: no logits)."""
        forward = self.model if self.head is None else self.model.get_decoder()
        inputs = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True)
        inputs[cache_keyword(type(forward))] = self.cache
        with self._engine_kernels():
            if self.head is None:
                logits = forward(**inputs, logits_to_keep=1 if keep is None else keep).logits[:, 0]
            else:
                hidden = forward(**inputs).last_hidden_state
        if keep is None:
            return None
        return logits if self.head is None else self.head(torch.take_along_dim(hidden, keep[..., None], dim=1)[:, 0])

    def release_weights(self) -> None:
        """Free the parameters and their packed copies until `load_weights` writes every parameter again, as empty
        tensors (reading one fails rather than reading freed memory). Buffers (e.g. rotary frequencies) are kept."""
        for kernel in self.kernels:
            kernel.release()
        for name, param in self.model.named_parameters():  # tied weights are one parameter: released once
            self.unwritten.setdefault(id(param), (param, None if name in self.packed_only else param.shape))
            param.data = param.data.new_empty(0)

    @property
    def missing_weights(self) -> list[str]:
        """Names of the parameters released and not written since."""
        return [name for name, param in self.model.named_parameters() if id(param) in self.unwritten]

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors into the model in place; names as in `model.state_dict()`."""
        for param, shape in self.unwritten.values():  # memory back for the released weights, written below
            if shape is not None and param.numel() == 0 and shape.numel():
                param.data = param.data.new_empty(shape)
        state = self.model.state_dict(keep_vars=True)
        for name, tensor in named_tensors:
            if name in self.packed_only:
                kernel, index, part, shape = self.packed_only[name]
                _check_shape(name, tensor, shape)
                kernel.write(index, part, tensor)
                self.unwritten.pop(id(state[name]), None)
                continue
            if name not in state:
                raise KeyError(f"update_weights: '{name}' is not in the engine model's state_dict")
            target = state[name]
            _check_shape(name, tensor, target.shape)
            target.copy_(tensor)
            self.unwritten.pop(id(target), None)
        for kernel in self.kernels:
            kernel.refresh()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state, with the weights kept only packed read back from the panels (copies)."""
        state = dict(self.model.state_dict())
        for name, (kernel, index, part, _) in self.packed_only.items():
            state[name] = kernel.read(index, part)
        return state


def _check_shape(name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
    if tensor.shape != shape:
        raise ValueError(f"update_weights: '{name}' has shape {tuple(tensor.shape)}, the engine model expects "
                         f"{tuple(shape)}")
