"""Tensor parallelism: DTensor plans per model family, applied before FSDP, in Megatron-LM's layout: q/k/v and
gate/up column-wise, o and down row-wise, the embedding row-wise and the LM head column-wise over the vocabulary
(`[..., V / tp]` logits, reduced by `RL2.models.vocab_parallel`); hidden-state norms and a scalar head replicated."""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from RL2.config.errors import ConfigError
from RL2.models.vocab_parallel import VocabShard

# style name -> a fresh ParallelStyle.
STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "vocab_head": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=True),
    # A norm over each head's features, fed `[B, T, heads / tp, head_dim]`: its replicated weight's gradient must
    # be summed over tp, which DTensor does with the input marked as split on the heads dimension.
    "per_head_norm": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
}

# Inside one decoder layer. Llama, Mistral and Qwen2 (q/k/v biases are split with their weights) share
# the layout; Qwen3 adds norms on each head of q and k.
DENSE_LAYER_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}
QK_NORM_LAYER_PLAN = DENSE_LAYER_PLAN | {"self_attn.q_norm": "per_head_norm", "self_attn.k_norm": "per_head_norm"}

# Outside the decoder layers, from the root of a ...ForCausalLM / ...ForTokenClassification model.
DENSE_ROOT_PLAN = {"model.embed_tokens": "vocab_embedding", "lm_head": "vocab_head"}

# HF `config.model_type` -> (decoder-layer plan, root plan).
TP_PLANS = {
    "llama": (DENSE_LAYER_PLAN, DENSE_ROOT_PLAN),
    "mistral": (DENSE_LAYER_PLAN, DENSE_ROOT_PLAN),
    "qwen2": (DENSE_LAYER_PLAN, DENSE_ROOT_PLAN),
    "qwen3": (QK_NORM_LAYER_PLAN, DENSE_ROOT_PLAN),
}


def check_tp_degree(config, tp: int) -> None:
    """Fail early, naming the key, when the model cannot be split `tp` ways."""
    if config.model_type not in TP_PLANS:
        raise ConfigError(
            f"tp_size={tp}: no tensor-parallel plan for model type '{config.model_type}' (known: "
            f"{', '.join(sorted(TP_PLANS))}); add one to TP_PLANS in RL2/models/tensor_parallel.py or set tp_size=1"
        )
    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ConfigError(f"tp_size={tp} must divide the model's {', '.join(f'{k}={v}' for k, v in bad.items())}; "
                         f"choose a tp_size that divides them")


def apply_tensor_parallel(model: torch.nn.Module, layers: list[torch.nn.Module], tp_mesh: DeviceMesh) -> VocabShard:
    """Split `model` over `tp_mesh` in place, where its weights are (no communication: the caller loads the
    real values afterwards). Returns the vocabulary slice of this rank's logits."""
    layer_plan, root_plan = TP_PLANS[model.config.model_type]
    for layer in layers:
        parallelize_module(layer, tp_mesh, {k: STYLES[v]() for k, v in layer_plan.items()}, src_data_rank=None)
    modules = dict(model.named_modules())
    present = {path: style for path, style in root_plan.items() if path in modules}
    parallelize_module(model, tp_mesh, {k: STYLES[v]() for k, v in present.items()}, src_data_rank=None)
    if "lm_head" not in present:  # a scalar head: whole logits
        return VocabShard()
    if getattr(model.config, "tie_word_embeddings", False):
        # Both were split by vocabulary row (Shard(0)) on the same mesh: one parameter serves both again.
        model.lm_head.weight = model.get_input_embeddings().weight
    # DTensor splits like torch.chunk: every slice but the last holds ceil(V / tp) ids.
    rows = -(-model.get_output_embeddings().weight.shape[0] // tp_mesh.size())
    return VocabShard(tp_mesh.get_group(), tp_mesh.get_local_rank() * rows)
