"""Linear layers for the embedded engine: weights packed once (a general CPU GEMM re-blocks the whole weight on every
call, which with a few dozen rows costs as much as the product), and layers that share an input (q, k, v; gate, up) as
one product: the C panels of docs/cpu.md, else oneDNN's packed CPU kernels, else (GPU) the plain products."""

import torch
import torch.nn.functional as F

from RL2.native.decode_kernels import DecodeKernels, load_decode_kernels


class PackedLinear:
    """`linears` (sharing an input) as one product over a packed copy of their weights, outputs concatenated in their
    order; subclasses say how to pack (`_pack`) and multiply (`_product`). A weight changed in place behind the
    engine's back (not through `param.data`: use `load_weights`) bumps its version counter and is re-packed."""

    packed_only = False  # the packed copy is the only one (`PanelLinear.keep_packed_only`)

    def __init__(self, linears: list[torch.nn.Linear]):
        self.linears = linears
        self.out_features = sum(linear.out_features for linear in linears)
        self._packed: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._versions: tuple[int, ...] = ()

    def refresh(self) -> None:
        """Re-pack if any weight or bias changed since it was packed."""
        if self.packed_only:  # no other copy to change
            return
        # Checked on every call: read the two attributes, not `parameters()`, which costs more.
        versions = tuple(p._version for linear in self.linears for p in (linear.weight, linear.bias) if p is not None)
        if versions == self._versions:
            return
        with torch.no_grad():
            self._packed = None  # free the stale copy first: peak memory stays one copy
            self._packed = self._pack([linear.weight.detach() for linear in self.linears])
            self._bias = None
            if any(linear.bias is not None for linear in self.linears):
                self._bias = torch.cat([
                    linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
                    for linear in self.linears
                ]).detach()
        self._versions = versions

    def release(self) -> None:
        """Drop the packed copy; the next call packs the weights again."""
        self._packed, self._bias, self._versions = None, None, ()

    def __call__(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The outputs `[..., out_features]`; where `out` is given, written into it (a product that
        cannot write into it, e.g. under autocast, returns a new tensor: use what is returned)."""
        # e.g. under autocast: the plain products. F.linear, not the modules: on the HF-module path
        # their forward is this very object (ModelRunner._engine_kernels).
        if hidden.dtype != self.linears[0].weight.dtype:
            if self.packed_only:
                raise TypeError(f"the engine's packed layers take {self.dtype} inputs, got {hidden.dtype} (autocast?)")
            return torch.cat([F.linear(hidden, linear.weight, linear.bias) for linear in self.linears], dim=-1)
        self.refresh()
        return self._product(hidden, out)


class OneDNNLinear(PackedLinear):
    """Weights reordered for oneDNN's CPU linear."""

    def _pack(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights) if len(weights) > 1 else weights[0])

    def _product(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(hidden, self._packed, self._bias, "none", [], "")


class PanelLinear(PackedLinear):
    """Float32 or bf16 weights in the panels of the C kernel `panel_linear` (`decode_kernels.c`). After
    `keep_packed_only` the panels are the layers' only copy (`write` puts new values into them; docs/cpu.md)."""

    def __init__(self, linears: list[torch.nn.Linear], kernels: DecodeKernels):
        super().__init__(linears)
        self.kernels = kernels
        self._firsts = [sum(linear.out_features for linear in linears[:i]) for i in range(len(linears))]

    def _pack(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return self.kernels.pack_panels(weights)

    def _product(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.panel_linear(hidden, self._packed, self.out_features, self._bias, out)

    @torch.no_grad()
    def keep_packed_only(self) -> None:
        """Pack the layers' weights now and drop their own copies (their parameters become empty tensors)."""
        self.refresh()
        self.in_features, self.dtype = self.linears[0].in_features, self.linears[0].weight.dtype
        for linear in self.linears:
            for param in (linear.weight, linear.bias):
                if param is not None:
                    param.data = param.data.new_empty(0)
        self.packed_only = True

    @torch.no_grad()
    def write(self, index: int, part: str, tensor: torch.Tensor) -> None:
        """Write layer `index`'s "weight" or "bias" into the packed copy (after `keep_packed_only`)."""
        first, rows = self._firsts[index], self.linears[index].out_features
        if part == "weight":
            if self._packed is None:  # released: the other layers' rows are written by their own calls
                self._packed = self.kernels.empty_panels(self.out_features, self.in_features, self.dtype)
            self.kernels.pack_rows(self._packed, tensor, first)
        else:
            if self._bias is None:  # layers without a bias add zeros
                self._bias = torch.zeros(self.out_features, dtype=self.dtype)
            self._bias[first : first + rows] = tensor

    def read(self, index: int, part: str) -> torch.Tensor | None:
        """A copy of layer `index`'s "weight" or "bias" as the products use it (None: the layer has no bias;
        an empty tensor: released)."""
        first, rows = self._firsts[index], self.linears[index].out_features
        if getattr(self.linears[index], part) is None:
            return None
        if part == "weight":
            if self._packed is None:  # released
                return torch.empty(0, dtype=self.dtype)
            return self.kernels.unpack_rows(self._packed, first, rows, self.linears[index].in_features)
        return torch.empty(0, dtype=self.dtype) if self._bias is None else self._bias[first : first + rows].clone()


class ConcatLinear(PackedLinear):
    """The same interface without packing (GPU, or CPUs without oneDNN's kernels): one product per layer."""

    def refresh(self) -> None:
        pass

    def __call__(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.linears) == 1:
            return self.linears[0](hidden)
        return torch.cat([linear(hidden) for linear in self.linears], dim=-1)


def panel_kernels_for(linear: torch.nn.Linear) -> DecodeKernels | None:
    """The C kernels where `PanelLinear` applies to this layer: on CPU, the library built, float32, or bf16 where it
    has bf16 panels (AVX512-BF16) and the CPU has no AMX (whose tiles oneDNN's bf16 kernels use, the panels not)."""
    if linear.weight.device.type != "cpu" or linear.weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    kernels = load_decode_kernels()
    if kernels is None:
        return None
    if linear.weight.dtype == torch.bfloat16 and (not kernels.bf16_panel_rows or torch.cpu._is_amx_tile_supported()):
        return None
    return kernels


def onednn_packing_works(linear: torch.nn.Linear) -> bool:
    """Packed oneDNN linears exist for CPU only, and bf16 needs CPU support (avx512/avx_ne_convert)."""
    if linear.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad():
            torch.ops.mkldnn._reorder_linear_weight(linear.weight[:8].detach())
    except (RuntimeError, AttributeError):
        return False
    return True
