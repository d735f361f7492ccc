"""The compute dtype of a run: `actor.dtype` made concrete for the hardware at hand."""

import torch

from RL2.utils.logging import log_rank0

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run in hardware: on CUDA, or on CPUs with AVX512-BF16 / AMX.

    Without it torch emulates bf16 on the CPU, far slower than float32.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """`actor.dtype` -> torch dtype; `auto` is bf16 where the hardware has it, else float32."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if name == "bfloat16" and not native_bf16(device):
        log_rank0("warning: this CPU has no native bf16 matmul (AVX512-BF16 or AMX); bf16 compute will be "
                  "far slower than float32. Set actor.dtype=auto or float32.")
    return DTYPES[name]
