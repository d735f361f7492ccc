"""The memory plan of colocated training and SGLang servers: parameter counts, the phases' bytes (with and without
LoRA), the tables of docs/gpus.md and docs/lora.md."""


import pytest

from benchmarks.memory_plan_table import (
    SMALL_GPU_ROWS,
    colocated_memory,
    kv_cache_tokens,
    lora_parameters,
    qwen25,
    readme_table,
)
from RL2.config.ppo_schema import COLOCATED_MARGIN_GB
from RL2.engine.memory_plan import GIB, colocated_mem_fraction
from tests.helpers import REPO

DOCS = REPO / "docs"


def qwen2_parameters(vocab, hidden, inter, layers, heads, kv_heads) -> int:
    """Qwen2's parameters written out: embeddings and an untied head, q/k/v with biases, o, the gated MLP, norms."""
    head_dim = hidden // heads
    attention = hidden * hidden + hidden + 2 * (hidden * kv_heads * head_dim + kv_heads * head_dim) + hidden * hidden
    mlp = 3 * hidden * inter
    return 2 * vocab * hidden + layers * (attention + mlp + 2 * hidden) + hidden


@pytest.fixture(scope="module")
def shapes():
    return {size: qwen25(size) for size in ("7B", "32B")}


def test_parameter_counts_of_the_table_models(shapes):
    assert shapes["7B"].n_params == qwen2_parameters(152064, 3584, 18944, 28, 28, 4) == 7_615_616_512
    assert shapes["32B"].n_params == qwen2_parameters(152064, 5120, 27648, 64, 40, 8)
    assert shapes["7B"].largest == 152064 * 3584
    assert shapes["7B"].kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # k and v, layers, heads, dim, bf16


def test_a_multimodal_config_is_sized_by_its_text_model():
    """Gemma 3 nests the decoder's sizes in text_config: the KV cache is the text model's."""
    from transformers import Gemma3Config

    from RL2.engine.memory_plan import ModelShape

    config = Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=1000),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14))
    shape = ModelShape.from_config(config)
    assert shape.kv_bytes_per_token == 2 * 3 * 2 * 16 * 2  # k and v, layers, kv heads, head dim, bf16
    assert shape.kv_heads == 2 and shape.largest >= 1000 * 64  # the embedding


def test_phases_of_7b_with_reference_and_critic_on_8_gpus(shapes):
    p = shapes["7B"].n_params
    plan = colocated_memory(shapes["7B"], 80 * GIB, n_ranks=8, server_tp=1, reference=True, critic=True)
    # fp32 weights + gradients + Adam moments for actor and critic, bf16 reference, each an eighth.
    assert plan.train == 2 * (16 * p // 8) + 2 * p // 8
    assert plan.sync == 4 * p // 8 + 2 * p + 2 * (2 * 152064 * 3584)  # the embedding outweighs a 512 MB bucket
    assert plan.served_weights == 2 * p
    assert plan.kv_cache == int(0.85 * 78 * GIB) - GIB - 2 * p  # rollout.gpu_memory_margin_gb's 1 GiB kept free
    assert kv_cache_tokens(shapes["7B"], plan.kv_cache, 1) == plan.kv_cache // (2 * 28 * 4 * 128 * 2)
    # On the host for the rollout: fp32 weights and Adam moments of actor and critic (no gradients after
    # the step), the bf16 reference; an eighth each.
    assert plan.host == 2 * ((4 + 8) * p // 8) + 2 * p // 8
    offloaded = colocated_memory(shapes["7B"], 80 * GIB, 8, 1, True, True, offload_optimizer=True)
    assert plan.train - offloaded.train == 8 * p // 8  # one model's moments on the GPU at a time


def test_the_margin_is_kept_free_beside_the_servers_share():
    """A server given `colocated_mem_fraction` of the memory free at its start takes 0.85 of it less the margin;
    the margin's default is the config's."""
    from RL2.config.ppo_schema import RolloutConfig

    assert RolloutConfig().gpu_memory_margin_gb == COLOCATED_MARGIN_GB == 1.0
    free, margin = 70 * GIB, 3 * GIB
    taken = colocated_mem_fraction(free, margin) * free
    assert taken == pytest.approx(0.85 * 70 * GIB - 3 * GIB)
    assert free - taken == pytest.approx(0.15 * 70 * GIB + 3 * GIB)  # SGLang's headroom and the margin
    assert colocated_mem_fraction(free, 0) == 0.85
    assert colocated_mem_fraction(GIB, GIB) <= 0  # no room: the launch refuses it


def test_gpus_page_has_the_plans_table():
    assert readme_table() in (DOCS / "gpus.md").read_text()


def test_lora_phases_of_7b_on_one_24gb_gpu(shapes):
    """LoRA: a bf16 base (which is also the reference) and float32 adapters with their gradients and Adam
    state; the sync streams the base from the CPU, so it needs the served weights, the buckets and one tensor."""
    model, p = shapes["7B"], shapes["7B"].n_params
    # r (in + out) for q (3584 -> 3584), k and v (3584 -> 512), o, gate and up (3584 -> 18944), down, per layer
    per_layer = 16 * (2 * 7168 + 2 * 4096 + 3 * (3584 + 18944))
    lora_params = lora_parameters(model.config, 16)
    assert lora_params == 28 * per_layer
    plan = colocated_memory(model, 24 * GIB, n_ranks=1, server_tp=1, reference=True, critic=False,
                            lora_params=lora_params)
    assert plan.train == 16 * lora_params + 2 * p
    assert plan.host == (4 + 8) * lora_params + 2 * p
    assert plan.sync == 2 * p + 2 * (2 * 152064 * 3584) + 2 * 152064 * 3584
    assert max(plan.train, plan.sync, plan.rollout) <= 22 * GIB  # fits next to 2 GiB of CUDA contexts
    full = colocated_memory(model, 24 * GIB, 1, 1, reference=True, critic=False)
    assert full.train == 16 * p + 2 * p > 24 * GIB


def test_lora_page_has_the_small_gpu_table():
    assert readme_table(24, SMALL_GPU_ROWS) in (DOCS / "lora.md").read_text()
