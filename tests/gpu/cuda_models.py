"""Random-weight models built from a config and a worker config, for the CUDA tests.

The tokenizer is the CPU tests' (`tests.helpers.tiny.tokenizer_path`: `RL2_TEST_TOKENIZER` or the
embedded SmolLM2 package). RL2's config package needs omegaconf, which a bare GPU machine may lack, so
`model_config` builds the few fields the workers read.
"""

from types import SimpleNamespace

from transformers import LlamaConfig


def llama_config(tokenizer, hidden: int = 256, layers: int = 4) -> LlamaConfig:
    """A small Llama with grouped-query attention and tied embeddings, on the tokenizer's vocabulary."""
    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def model_config(path: str, dtype: str, **overrides) -> SimpleNamespace:
    """The `actor` fields FSDPWorker reads, with the schema's defaults (RL2/config/schema.py)."""
    fields = dict(model_name=path, tokenizer_name=None, dtype=dtype, max_length_per_device=4096,
                  enable_gradient_checkpointing=False, checkpoint_every_n_layers=1,
                  max_grad_norm=1.0, offload_optimizer=False, avg_level="token",
                  tp_size=1, cp_size=1, ddp_size=1,
                  optimizer=SimpleNamespace(lr=1e-3, weight_decay=0.0, betas=[0.9, 0.999], eps=1e-8),
                  scheduler=SimpleNamespace(name="constant", warmup_ratio=0.0, min_lr=0.0),
                  lora=SimpleNamespace(rank=0, alpha=32.0, dropout=0.0,
                                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"]))
    return SimpleNamespace(**(fields | overrides))
