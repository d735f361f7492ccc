"""Activation checkpointing of a HF model's decoder layers: all of them, or every n-th, which saves about
1/n of the memory that checkpointing them all saves, at about 1/n of its extra time."""

import torch
from transformers.modeling_layers import GradientCheckpointingLayer


def enable_activation_checkpointing(model: torch.nn.Module, every_n_layers: int = 1) -> None:
    """Recompute every n-th decoder layer (the first, the (n+1)-th, ...) in backward: HF's switch, non-reentrant."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5.24 on
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if every_n_layers > 1 and not layers:
        raise ValueError(
            f"checkpoint_every_n_layers={every_n_layers}, but {type(model).__name__} has no decoder layers that "
            f"checkpoint one by one (transformers' GradientCheckpointingLayer); set checkpoint_every_n_layers=1"
        )
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index % every_n_layers == 0
