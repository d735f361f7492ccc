"""The trainer's parameters under the names and in the layout of the model's checkpoint, which SGLang's loaders read
(docs/gpus.md, "SGLang servers"): a mixture of experts reverted the way `save_pretrained` does (transformers'
`conversion_mapping.py`, `core_model_loading.py`); dense models pass through unchanged."""

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, WeightConverter, revert_weight_conversion


class CheckpointLayout:
    """The layout of `model`, a transformers model of the trained class on any device (the meta device does:
    only its structure and config are read); `from_folder` builds one from a checkpoint's config."""

    def __init__(self, model: torch.nn.Module):
        conversions = getattr(model, "_weight_conversions", None)  # those of `from_pretrained`, if it loaded the model
        if conversions is None:
            # What `revert_weight_conversion` reverses for a model built from its config (as the trainer builds its
            # own): the model's mapping without the legacy renamings and prefix changes, which depend on how a
            # checkpoint was loaded. Kept on the model, where `revert_weight_conversion` reads it at each call.
            conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                           if not isinstance(c, PrefixChange)]
            model._weight_conversions = conversions or None
        self.model, self.conversions = model, list(conversions)
        reverse = [c.reverse_transform() for c in conversions[::-1]]
        converters = [c for c in reverse if isinstance(c, WeightConverter)]
        # Which in-memory parameters one reverse converter takes together: those it renames to the same key.
        self.group_of: dict[str, str] = {}
        self.members: dict[str, set[str]] = {}
        for name, _ in model.named_parameters():
            # The first converter that matches renames it (transformers converts a tensor with one at most), by
            # `WeightTransform.rename_source_key`: `core_model_loading.apply_converters` needs transformers 5.21.
            for converter in converters:
                key, pattern = converter.rename_source_key(name)
                if pattern is not None:
                    self.group_of[name] = key
                    self.members.setdefault(key, set()).add(name)
                    break

    @classmethod
    def from_folder(cls, model_path: str | Path) -> "CheckpointLayout":
        """The layout of the causal LM whose Hugging Face folder is `model_path` (built on the meta device)."""
        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            return cls(AutoModelForCausalLM.from_config(config))

    @property
    def converts(self) -> bool:
        """Whether transformers converts this model between memory and checkpoint (else names pass through)."""
        return bool(self.conversions)

    def to_checkpoint(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Full tensors under the model's parameter names, in any order, as the checkpoint holds them: `named_tensors`
        itself when nothing converts; else each group (`members`) converted once its last tensor has arrived, so that
        no more than a layer's experts are held beyond the caller's buckets; ValueError if a group stays incomplete."""
        if not self.converts:
            return named_tensors
        return self._converted(named_tensors)

    def checkpoint_names(self) -> set[str]:
        """The names `to_checkpoint` gives this model's parameters (computed on the meta device)."""
        params = ((name, torch.empty_like(p, device="meta")) for name, p in self.model.named_parameters())
        return {name for name, _ in self.to_checkpoint(params)}

    def _converted(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named_tensors:
            key = self.group_of.get(name)
            if key is None:  # renamed at most
                yield from revert_weight_conversion(self.model, {name: tensor}).items()
                continue
            group = pending.setdefault(key, {})
            group[name] = tensor
            if len(group) == len(self.members[key]):
                del pending[key]
                yield from revert_weight_conversion(self.model, group).items()
        if pending:
            missing = sorted(n for key, group in pending.items() for n in self.members[key] - group.keys())
            raise ValueError(f"CheckpointLayout: {len(missing)} parameters of {type(self.model).__name__} never came, "
                             f"so the tensors converted with them could not be: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def checkpoint_tensor_names(model_path: str | Path) -> set[str] | None:
    """The tensor names of a Hugging Face folder's safetensors files; None when it has none (e.g. `.bin` files)."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.update(f.keys())
    return names
