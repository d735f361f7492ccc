"""Tiny random-weight models with the embedded model's real tokenizer and chat template."""

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from RL2.models.embedded import resolve_model_path


def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))


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
