"""Refuse, before loading, a CPU model that cannot fit this host's memory, rather than load it for minutes
and be killed mid-step (docs/cpu.md, "What fits"). The figure checked is a floor (this host's shards of the
weights, and of a trained model's gradients and AdamW moments): passing does not mean it fits; failing, it cannot."""

import os

import torch

TRAINED_BYTES_PER_PARAMETER = 16  # float32 weights, gradients and AdamW's two moments


def host_capacity_bytes() -> int | None:
    """Memory plus swap of this host (Linux; None elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
    except OSError:
        return None
    return fields.get("MemTotal", 0) + fields.get("SwapTotal", 0)


def least_host_bytes(n_parameters: int, bytes_per_parameter: int, shards: int, ranks_on_host: int) -> int:
    """What the ranks of one host hold at least of a model each rank holds 1/`shards` of."""
    return n_parameters * bytes_per_parameter * ranks_on_host // shards


def check_model_fits_host(model: torch.nn.Module, name: str, trained: bool, param_dtype: torch.dtype,
                          shards: int) -> None:
    """Raise when the floor of `model`'s memory on this host (`model` on the meta device: only its parameter
    count is read) exceeds its memory and swap. `trained`: fully trained, rather than frozen or LoRA's base;
    `shards`: the ranks one copy of the model is split over (each hybrid-sharding replica holds a copy)."""
    capacity = host_capacity_bytes()
    if capacity is None:
        return
    n_parameters = sum(p.numel() for p in model.parameters())
    per_parameter = TRAINED_BYTES_PER_PARAMETER if trained else param_dtype.itemsize
    ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", shards))
    need = least_host_bytes(n_parameters, per_parameter, shards, ranks_on_host)
    if need <= capacity:
        return
    what = ("its float32 weights, gradients and AdamW moments (16 bytes a parameter)" if trained
            else f"its {param_dtype} weights ({per_parameter} bytes a parameter)")
    raise MemoryError(
        f"{name} has {n_parameters / 1e9:.2f}B parameters: {what}, split over {shards} rank(s), "
        f"{ranks_on_host} of them on this host, need at least {need / 1e9:.1f} GB here before any activation, and "
        f"this host has {capacity / 1e9:.1f} GB of memory and swap. "
        + ("Train it with LoRA (e.g. lora.rank=16 in that model's section), over more hosts, or pick a smaller model."
           if trained else "Run over more hosts, or pick a smaller model.")
    )
