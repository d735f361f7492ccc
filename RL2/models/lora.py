"""LoRA: a frozen base model with trained low-rank adapters (Hu et al. 2021, arXiv 2106.09685; docs/lora.md), under
PEFT's module and parameter names (`q_proj.base_layer.weight`, `q_proj.lora_A.weight`). The rollout engine and the
export see the base model's names, with the adapters merged (`merge_adapters`, `split_for_export`)."""

import json
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from RL2.config.errors import ConfigError

ALL_LINEAR = "all-linear"
# Modules trained in full next to the adapters (PEFT's `modules_to_save`): the scalar head of
# `AutoModelForTokenClassification`, new in a reward model or critic.
HEAD_MODULES = ("score",)
BASE, ADAPTER_A, ADAPTER_B = ".base_layer.", ".lora_A.weight", ".lora_B.weight"
PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    """A linear layer plus a low-rank adapter: `base_layer(x) + scaling * lora_B(lora_A(dropout(x)))`.
    `base` may be on any device (meta included) and tensor-parallel: the adapter follows its split."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base
        device = base.weight.device
        # float32 weights: they are trained.
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's initialisation
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        self.enabled = True
        self.input_placement = None  # under tensor parallelism: how the input is split over the tp ranks
        if isinstance(base.weight, DTensor):
            self._split_like_base(base.weight)

    def _split_like_base(self, weight: DTensor) -> None:
        (placement,) = weight.placements
        if placement == Shard(0):  # column-wise: whole input, a slice of the outputs
            a, b, self.input_placement = Replicate(), Shard(0), Replicate()
        elif placement == Shard(1):  # row-wise: a slice of the input features
            a, b, self.input_placement = Shard(1), Replicate(), Shard(-1)
        else:
            raise ValueError(f"LoRA cannot follow a base weight split as {weight.placements}")
        for linear, split in ((self.lora_A, a), (self.lora_B, b)):
            linear.weight = nn.Parameter(distribute_tensor(linear.weight.data, weight.device_mesh, [split],
                                                           src_data_rank=None))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the adapter's input, as one process would draw it. Tensor-parallel ranks share a random stream
        (`FSDPWorker` keeps them so): column-wise they hold the same input and draw the same mask; row-wise each holds
        a slice of the features, so each draws the whole input's mask and keeps its slice."""
        if not isinstance(self.input_placement, Shard) or not isinstance(self.lora_dropout, nn.Dropout):
            return self.lora_dropout(x)
        mesh, width, p = self.lora_A.weight.device_mesh, x.shape[-1], self.lora_dropout.p  # mesh: the tp mesh
        keep = torch.empty(*x.shape[:-1], width * mesh.size(), dtype=x.dtype, device=x.device)
        keep = keep.bernoulli_(1 - p).div_(1 - p)  # as torch's dropout draws and scales its mask
        return x * keep.narrow(-1, mesh.get_local_rank() * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if not self.enabled:
            return out
        if torch.is_grad_enabled():  # only passes that train: log-probs for the loss's ratios stay exact
            x = self._dropout(x)
        if self.input_placement is None:
            return out + self.lora_B(self.lora_A(x)) * self.scaling
        a, b = self.lora_A.weight, self.lora_B.weight
        placement = Shard(x.dim() - 1) if isinstance(self.input_placement, Shard) else self.input_placement
        hidden = F.linear(DTensor.from_local(x, a.device_mesh, [placement], run_check=False), a)
        hidden = hidden.redistribute(placements=[Replicate()])  # row-wise: the sum of the rank-r partial products
        return out + F.linear(hidden, b).to_local() * self.scaling


def target_linears(model: nn.Module, layers: list[nn.Module], targets: list[str]) -> dict[str, nn.Linear]:
    """Module path -> linear layer of every target inside the decoder layers (never the LM head or a scalar
    head): a target matches a path that ends in it (`q_proj`, `self_attn.q_proj`); `all-linear` takes all."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    return {name: module for name, module in model.named_modules()
            if id(module) in inside and isinstance(module, nn.Linear)
            and (ALL_LINEAR in targets or any(name == t or name.endswith("." + t) for t in targets))}


def add_adapters(model: nn.Module, layers: list[nn.Module], rank: int, alpha: float, dropout: float,
                 targets: list[str]) -> list[str]:
    """Wrap the target linear layers inside `layers` (the decoder layers) of an HF model, not yet FSDP-sharded, in
    `LoRALinear`; freeze all but the adapters and the scalar head (made float32, as they are). Returns the paths."""
    found = target_linears(model, layers, targets)
    if not found:
        names = sorted({name.rsplit(".", 1)[-1] for layer in layers for name, m in layer.named_modules()
                        if isinstance(m, nn.Linear)})
        raise ConfigError(f"lora.target_modules={list(targets)} matches no linear layer of {type(model).__name__}; "
                         f"its decoder layers have {', '.join(names) or 'none'} (or use [{ALL_LINEAR}])")
    model.requires_grad_(False)
    for name, linear in found.items():
        model.set_submodule(name, LoRALinear(linear, rank, alpha, dropout))
    for head in HEAD_MODULES:
        module = getattr(model, head, None)
        if module is not None:
            module.float().requires_grad_(True)
    return sorted(found)


def adapter_modules(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, `model` computes with its base weights alone: the reference of DPO and PPO under LoRA."""
    modules = adapter_modules(model)
    for module in modules:
        module.enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.enabled = True


def merge_adapters(named_tensors: Iterable[tuple[str, torch.Tensor]],
                   scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of a LoRA model in `named_parameters` order -> the base model's, each adapted weight merged
    (`W + scaling * B A`, in float32): only a layer's base weight waits, for its A and B, which come after it."""
    waiting: dict[str, list[torch.Tensor]] = {}  # module path -> [W, A]
    for name, tensor in named_tensors:
        if BASE in name:
            prefix, _, param = name.partition(BASE)
            if param == "weight":
                waiting[prefix] = [tensor]
            else:
                yield f"{prefix}.{param}", tensor
        elif name.endswith(ADAPTER_A):
            waiting[name.removesuffix(ADAPTER_A)].append(tensor)
        elif name.endswith(ADAPTER_B):
            prefix = name.removesuffix(ADAPTER_B)
            weight, a = waiting.pop(prefix)
            yield f"{prefix}.weight", (weight.float() + scaling * (tensor.float() @ a.float())).to(weight.dtype)
        else:
            yield name, tensor


def split_for_export(state: dict[str, torch.Tensor],
                     scaling: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A full state dict of a LoRA model -> (merged state dict under the base model's names, PEFT adapter
    state dict: the adapters and the scalar head under PEFT's key names)."""
    adapter = {PEFT_PREFIX + name: tensor for name, tensor in state.items()
               if name.endswith((ADAPTER_A, ADAPTER_B)) or name.split(".")[0] in HEAD_MODULES}
    return dict(merge_adapters(state.items(), scaling)), adapter  # a state dict is in parameter order


def save_adapter(folder: str | Path, adapter: dict[str, torch.Tensor], rank: int, alpha: float, dropout: float,
                 task_type: str, base_model: str) -> None:
    """Write a PEFT adapter folder (`peft.PeftModel.from_pretrained(base_model, folder)` loads it) of an
    `adapter` from `split_for_export`; `task_type` is PEFT's (CAUSAL_LM, or TOKEN_CLS for a scalar head)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(folder / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    heads = sorted({name.removeprefix(PEFT_PREFIX).split(".")[0] for name in adapter} & set(HEAD_MODULES))
    # The adapted layers' names, as PEFT matches them (RL2's `all-linear`, unlike PEFT's, stays in the layers).
    targets = sorted({name.removesuffix(ADAPTER_A).rsplit(".", 1)[-1] for name in adapter if name.endswith(ADAPTER_A)})
    config = {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
        "modules_to_save": heads or None, "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def merge_into_base(model: nn.Module, fraction: float) -> None:
    """`W += fraction * scaling * B A`, `B *= 1 - fraction`: the model computes the same, its base (`adapters_disabled`)
    moves `fraction` of the way to it (ProRL's reference reset under LoRA). On FSDP-sharded (and tp) parameters, put
    back in place first (`reshard`): every rank computes a layer's full B A and adds its part."""
    for module in adapter_modules(model):
        weight = module.base_layer.weight
        a, b = module.lora_A.weight, module.lora_B.weight
        a_full, b_full = (t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b))
        delta = (fraction * module.scaling) * (b_full.float() @ a_full.float())
        if isinstance(weight, DTensor):
            local = weight.to_local()  # this rank's part of the full delta, cut as W is
            local += distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None).to_local().to(
                local.dtype)
        else:
            weight += delta.to(weight.dtype)
        (b.to_local() if isinstance(b, DTensor) else b).mul_(1 - fraction)


def lora_parameters(model: nn.Module, layers: list[nn.Module], rank: int, targets: list[str]) -> int:
    """Parameters of the adapters `add_adapters` would add: r (in + out) per target layer."""
    return sum(rank * (m.in_features + m.out_features) for m in target_linears(model, layers, targets).values())
