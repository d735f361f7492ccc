"""What the LoRA tests share: the merge W + (alpha / r) B A computed from saved tensors alone."""

import torch


def expected_merge(base: dict, adapter: dict, scale: float,
                   prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
    """The base weights with W + scale * B A at every adapted layer of a PEFT adapter's tensors."""
    merged = dict(base)
    for key, weight in base.items():
        a = adapter.get(f"{prefix}{key.removesuffix('.weight')}.lora_A.weight")
        if a is not None:
            b = adapter[f"{prefix}{key.removesuffix('.weight')}.lora_B.weight"]
            merged[key] = weight + scale * (b @ a)
    return merged
