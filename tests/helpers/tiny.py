"""Tiny random-weight models with the default model's real tokenizer and chat template.

Nothing here downloads anything: the tokenizer comes from `RL2_TEST_TOKENIZER` (a folder saved with
`save_pretrained`, small enough to carry to a machine without the embedded model's package, such as a
GPU machine) or else from the embedded SmolLM2 package.
"""

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from RL2.models.default_model import resolve_model_path


def tokenizer_path() -> str:
    return os.environ.get("RL2_TEST_TOKENIZER") or resolve_model_path("smollm2-135m-instruct")


def tokenizer():
    return AutoTokenizer.from_pretrained(tokenizer_path())


def make_tiny_model(folder: Path, seed: int = 0, layers: int = 2) -> str:
    """Save a ~3.3 M-parameter Llama (mostly its 49k-token embedding) plus tokenizer to `folder`."""
    tok = tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def make_tiny_qwen(folder: Path, family: str = "qwen3", seed: int = 0) -> str:
    """A tiny Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms) with untied embeddings; 4 query and
    4 key/value heads, so that tensor parallelism can split them 2 or 4 ways."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    tok = tokenizer()
    config = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=2048,
                        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def sharpened_copy(path: str, folder: Path) -> str:
    """The model at `path` with its final norm scaled 10x, saved to `folder`: peaked next-token
    distributions. A random tiny model's near-zero logits make softmax terms (entropy gradients)
    nearly cancel; sharpened, it also repeats the prompt's last token about a third of the time."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    return str(folder)


def make_tiny_moe(folder: Path, family: str = "qwen3_moe", seed: int = 0) -> str:
    """A tiny mixture-of-experts model, Qwen3-MoE (q/k norms, `mlp.experts.{e}.gate_proj`) or Mixtral
    (`block_sparse_moe.experts.{e}.w1`): 4 experts, 2 per token, untied embeddings. transformers holds
    their experts fused (`mlp.experts.gate_up_proj [E, 2I, H]`); the folder has them per expert."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False,
                  num_experts_per_tok=2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, intermediate_size=128, norm_topk_prob=True,
                                **common)
        model_cls = Qwen3MoeForCausalLM
    elif family == "mixtral":
        config, model_cls = MixtralConfig(num_local_experts=4, intermediate_size=32, **common), MixtralForCausalLM
    else:
        raise ValueError(f"make_tiny_moe: family is qwen3_moe or mixtral, not {family!r}")
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)
