"""RMSNorm and the SwiGLU activation of Llama-family models as one C pass each, forward and backward, for float32
and bfloat16 training on CPU (`fused_layers.c`; docs/cpu.md). A call with tensors they do not take (another dtype
or device, a DTensor or other subclass) runs HF's own code, so an installed model stays correct anywhere."""

import ctypes
import functools
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from RL2.native import switches
from RL2.native.build import FLOAT, INT, POINTER, SUFFIXES, load_library

SOURCE = Path(__file__).with_name("fused_layers.c")
KERNELS = {
    "rms_norm_forward": [POINTER] * 4 + [INT, INT, FLOAT],
    "rms_norm_backward": [POINTER] * 6 + [INT, INT],
    "rms_norm_apply": [POINTER] * 4 + [INT, INT],
    "silu_mul_forward": [POINTER] * 3 + [INT],
    "silu_mul_backward": [POINTER] * 6 + [INT],
}
# The C file has each kernel once per dtype, its name ending in the dtype's suffix.
SIGNATURES = {name + suffix: types for name, types in KERNELS.items() for suffix in SUFFIXES.values()}
RETURNS = {"rms_norm_backward" + suffix: ctypes.c_int for suffix in SUFFIXES.values()}
# Modules whose forward is exactly HF Llama's RMSNorm (weight * x / rms) or gated MLP
# (down(act(gate(x)) * up(x))); Gemma's (1 + weight) norm, for one, is not.
RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
GATED_MLPS = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}
INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@functools.cache
def _library() -> ctypes.CDLL | None:
    return load_library(SOURCE, switches.fused_layers(), "the trainer's RMSNorm and MLP run as torch ops", SIGNATURES,
                        RETURNS)


def _fusable(*tensors: torch.Tensor) -> bool:
    """Plain CPU tensors of one dtype the kernels have: not a DTensor or any other subclass (tensor
    parallelism's outputs can be wrappers whose data is not in their own storage yet)."""
    return tensors[0].dtype in SUFFIXES and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == tensors[0].dtype
        for t in tensors
    )


def _kernel(name: str, dtype: torch.dtype):
    return getattr(_library(), name + SUFFIXES[dtype])


def _plain_gradient(grad_out: torch.Tensor, like: torch.Tensor, layer: str) -> torch.Tensor:
    """`grad_out` as the kernels read it (the dtype of `like`); one they cannot read raises rather than be misread."""
    if not _fusable(grad_out, like):
        raise TypeError(f"the fused {layer} got a {type(grad_out).__name__} gradient of dtype {grad_out.dtype} on "
                        f"{grad_out.device} for its {like.dtype} input; it takes plain CPU tensors of the input's "
                        f"dtype (RL2_FUSED_LAYERS=0 switches it off)")
    return grad_out.contiguous()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = x.contiguous()
        out, rstd = torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)
        dim = x.shape[-1]
        _kernel("rms_norm_forward", x.dtype)(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rstd.data_ptr(),
                                             x.numel() // dim, dim, eps)
        ctx.save_for_backward(x, weight, rstd)
        # What an input projection reading `out` keeps instead of it (`_LinearOfNorm`); the version tells
        # whether `out` was changed in place since.
        out._rl2_norm_source = (x, weight, rstd, out._version, _SharedRecompute())
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_out = _plain_gradient(grad_out, x, "RMSNorm")
        grad_x, grad_weight = torch.empty_like(x), torch.empty_like(weight)
        dim = x.shape[-1]
        if _kernel("rms_norm_backward", x.dtype)(x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), grad_out.data_ptr(),
                                                 grad_x.data_ptr(), grad_weight.data_ptr(), x.numel() // dim, dim):
            raise MemoryError("rms_norm_backward: no memory for its per-thread weight-gradient sums")
        return grad_x, grad_weight if ctx.needs_input_grad[1] else None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return _silu_mul_forward(gate, up)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_out = _plain_gradient(grad_out, gate, "SwiGLU activation")
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        _silu_mul_backward(gate, up, grad_out, grad_gate, grad_up, None)
        return grad_gate, grad_up


class _SiluMulDown(torch.autograd.Function):
    """`down(silu(gate) * up)`, down without bias. Keeps gate and up but not their product (a decoder layer's largest
    activation per token): backward writes it again in the pass that computes gate's and up's gradients."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up, weight)
        return F.linear(_silu_mul_forward(gate, up), weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        grad_out = _plain_gradient(grad_out, gate, "SwiGLU MLP")
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_product = (rows @ weight).view(gate.shape)
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        product = torch.empty_like(gate) if ctx.needs_input_grad[2] else None
        _silu_mul_backward(gate, up, grad_product, grad_gate, grad_up, product)
        del grad_product
        grad_weight = rows.t() @ product.view(-1, product.shape[-1]) if product is not None else None
        return grad_gate, grad_up, grad_weight


class _SharedRecompute:
    """The norm output that the backwards of the projections reading it (q, k, v; gate, up) recompute: by the first,
    dropped by the last. Holds no forward tensor: the graph's stay in `saved_tensors`, which checkpointing can drop."""

    def __init__(self):
        self.readers, self.output = 0, None

    def take(self, compute) -> torch.Tensor:
        if self.output is None:
            self.output = compute()
        output, self.readers = self.output, self.readers - 1
        if self.readers <= 0:  # the last reader (or a second backward through the graph): drop it
            self.output = None
        return output


class _LinearOfNorm(torch.autograd.Function):
    """`F.linear(x, weight, bias)` of a fused RMSNorm's output x: keeps the norm's input and rstd (kept anyway), not x,
    and computes x again in backward: a decoder layer keeps no copy of its two norms' outputs."""

    @staticmethod
    def forward(ctx, x, weight, bias, norm_input, norm_weight, rstd, shared: _SharedRecompute):
        ctx.save_for_backward(weight, norm_input, norm_weight, rstd)
        ctx.shared = shared
        shared.readers += 1
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        weight, norm_input, norm_weight, rstd = ctx.saved_tensors
        grad_out = _plain_gradient(grad_out, norm_input, "input projection")
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = (rows @ weight).view(norm_input.shape) if ctx.needs_input_grad[0] else None
        wants_weight = ctx.needs_input_grad[1]
        # Every reader takes its turn, wanting x or not, so that the last one drops it.
        x = ctx.shared.take(lambda: _rms_norm_again(norm_input, norm_weight, rstd) if wants_weight else None)
        grad_weight = rows.t() @ x.view(-1, x.shape[-1]) if wants_weight else None
        grad_bias = rows.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None, None


def _rms_norm_again(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """`_RMSNorm`'s output, bit for bit, from its input, weight and the rstd it kept."""
    out, dim = torch.empty_like(x), x.shape[-1]
    _kernel("rms_norm_apply", x.dtype)(x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), out.data_ptr(),
                                       x.numel() // dim, dim)
    return out


def _input_projection_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`_LinearOfNorm` where `x` is a fused norm's output, unchanged since, and autograd records; else `F.linear`."""
    source = getattr(x, "_rl2_norm_source", None)
    params = [module.weight] + ([] if module.bias is None else [module.bias])
    if source is not None and source[3] == x._version and torch.is_grad_enabled() and _fusable(x, *params):
        return _LinearOfNorm.apply(x, module.weight, module.bias, *source[:3], source[4])
    return F.linear(x, module.weight, module.bias)


def _silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(gate)
    _kernel("silu_mul_forward", gate.dtype)(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def _silu_mul_backward(gate, up, grad_out, grad_gate, grad_up, product: torch.Tensor | None) -> None:
    _kernel("silu_mul_backward", gate.dtype)(gate.data_ptr(), up.data_ptr(), grad_out.data_ptr(), grad_gate.data_ptr(),
                                             grad_up.data_ptr(), None if product is None else product.data_ptr(),
                                             gate.numel())


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, in one pass where the kernels take the tensors."""
    if _library() is not None and _fusable(gate, up) and gate.shape == up.shape:
        return _SiluMul.apply(gate, up)
    return F.silu(gate) * up


def _rms_norm_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if _fusable(hidden_states, module.weight) and hidden_states.shape[-1:] == module.weight.shape:
        out = _RMSNorm.apply(hidden_states, module.weight, module.variance_epsilon)
        if not torch.is_grad_enabled():
            del out._rl2_norm_source  # nothing is kept for a backward: the norm's input may go
        return out
    return type(module).forward(module, hidden_states)


def _plain_linear(module: torch.nn.Module) -> bool:
    """A torch Linear without bias or hooks: calling its weight directly skips nothing (a LoRA layer, an
    FSDP-wrapped or hooked Linear is called as a module)."""
    return (type(module) is torch.nn.Linear and module.bias is None
            and not (module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
                     or module._backward_pre_hooks))


def _gated_mlp_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = module.gate_proj(x), module.up_proj(x)  # installed where act_fn is silu
    down = module.down_proj
    if _plain_linear(down) and _fusable(gate, up, down.weight) and gate.shape == up.shape:
        return _SiluMulDown.apply(gate, up, down.weight)
    return down(silu_mul(gate, up))


def install_fused_layers(model: torch.nn.Module) -> int:
    """Point `model`'s Llama-style RMSNorms and SiLU-gated MLPs, and the Linears that read the norms'
    outputs, at the fused kernels. Returns how many norms and MLPs were changed."""
    if _library() is None:
        return 0
    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if name in RMS_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_forward, module)
            changed += 1
        elif name in GATED_MLPS and getattr(module.config, "hidden_act", None) == "silu":
            module.forward = types.MethodType(_gated_mlp_forward, module)
            changed += 1
        # The Linears reading a norm's output; only `forward` changes: hooks and wrappers (LoRA) still run.
        for child_name in INPUT_PROJECTIONS:
            child = getattr(module, child_name, None)
            if type(child) is torch.nn.Linear:
                child.forward = types.MethodType(_input_projection_forward, child)
    return changed
