"""The compute dtype of a run: `actor.dtype` made concrete for the hardware at hand."""

import functools
import platform

import torch

from RL2.native.build import cpuinfo
from RL2.utils.logging import log_rank0

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run in hardware (else emulated, far slower than float32): on Ampere GPUs and
    newer (a V100 or T4 emulates, though `torch.cuda.is_bf16_supported()` says True), or CPUs with AVX512-BF16 / AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _cpu_vendor() -> str:
    return cpuinfo("vendor_id")


def bf16_pays_off(device: torch.device) -> bool:
    """Whether bf16 is the faster choice: where native, but not on Intel CPUs without AMX (AVX512-BF16 at about half the
    float32 rate). A rule on the hardware, not a timing, so that every rank and run on the machine computes alike."""
    if device.type == "cuda" or not native_bf16(device):
        return native_bf16(device)
    intel = platform.machine() in ("x86_64", "AMD64") and _cpu_vendor() == "GenuineIntel"
    return not intel or torch.cpu._is_amx_tile_supported()


@functools.cache
def _warn_once(message: str) -> None:  # the trainer and the engine both resolve the dtype
    log_rank0(message)


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """`actor.dtype` -> torch dtype; `auto` is bf16 where it is the faster choice (`bf16_pays_off`), else float32."""
    if name == "auto":
        return torch.bfloat16 if bf16_pays_off(device) else torch.float32
    if name == "bfloat16" and not native_bf16(device) and device.type == "cuda":
        _warn_once("warning: this GPU has no native bf16 matmul (it needs compute capability 8.0, Ampere, or newer); "
                   "bf16 compute will be emulated, far slower than float32 or float16. Set actor.dtype=float16 or "
                   "auto (float32).")
    elif name == "bfloat16" and not native_bf16(device):
        _warn_once("warning: this CPU has no native bf16 matmul (AVX512-BF16 or AMX); bf16 compute will be "
                   "far slower than float32. Set actor.dtype=auto or float32.")
    elif name == "bfloat16" and not bf16_pays_off(device):
        _warn_once("warning: this CPU runs bf16 matmuls through AVX512-BF16 without AMX, at about half the float32 "
                   "rate; float32 compute (actor.dtype=auto or float32) is faster here, at twice the activation "
                   "memory.")
    return DTYPES[name]
