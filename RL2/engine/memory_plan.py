"""The sizing of SGLang servers that share the GPUs with the trainer: docs/gpus.md ("Memory plan") explains the phases
of a colocated step and their formulas, which `benchmarks/memory_plan_table.py` computes into its table."""

from dataclasses import dataclass

import torch

GIB = 2**30
COLOCATED_MEM_FRACTION = 0.85


def colocated_mem_fraction(free_bytes: int, margin_bytes: int) -> float:
    """`mem_fraction_static` of a server launched beside the trainer (SGLang gives weights plus KV cache that share of
    the memory free at its start): `COLOCATED_MEM_FRACTION` of the `free_bytes` it starts with, less `margin_bytes`,
    what the trainer's memory left on the GPU may grow by once the servers have started (0 or less: no room)."""
    return COLOCATED_MEM_FRACTION - margin_bytes / free_bytes


@dataclass
class ModelShape:
    """What the plan needs to know of a model."""

    name: str  # for messages and tables
    n_params: int  # parameters (embeddings and LM head included, tied ones once)
    largest: int  # elements of the largest parameter (the embedding): a bucket holds at least it
    kv_bytes_per_token: int  # bytes of one token's keys and values over all layers, in bf16
    kv_heads: int  # key/value heads (tensor parallelism splits them)
    config: object = None  # the HF config it was counted from (for the LoRA adapters' size in the table)

    @classmethod
    def from_config(cls, config, name: str = "") -> "ModelShape":
        """Count parameters by building the model on the meta device (no memory)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = list(model.parameters())  # tied weights appear once
        text = config.get_text_config()  # the decoder's sizes, nested in multimodal configs (Gemma 3)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(name or getattr(config, "model_type", "model"), sum(p.numel() for p in params),
                   max(p.numel() for p in params), 2 * text.num_hidden_layers * kv_heads * head_dim * 2, kv_heads,
                   config)
