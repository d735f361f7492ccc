"""LoRA (`actor.lora.rank`, `critic.lora.rank`): only the adapters (and a reward model's head) train and
fill the optimizer and checkpoints; the merged export equals base + (alpha / r) B A computed from the
saved tensors, and the PEFT adapter folder loads with `peft`; 2 ranks (FSDP or tensor parallel) equal
1 rank; a resumed run ends where an uninterrupted one does; DPO's and PPO's reference is the base with
the adapters off; the rollout engine samples the merged weights after every update."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForTokenClassification, LlamaConfig, LlamaForCausalLM

from RL2.models.lora import (
    LoRALinear,
    adapters_disabled,
    add_adapters,
    merge_adapters,
    merge_into_base,
    split_for_export,
)
from tests.helpers.lora import expected_merge

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = [f"actor.lora.rank={RANK}", f"actor.lora.alpha={ALPHA}"]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def with_adapters(model: nn.Module, targets=TARGETS) -> nn.Module:
    add_adapters(model, list(model.model.layers), RANK, ALPHA, 0.0, list(targets))
    with torch.no_grad():  # adapters as if trained: B away from its zero start
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.weight.normal_(std=0.5)
    return model


def test_bad_lora_settings_fail_naming_the_key():
    from RL2.config import ConfigError, parse_config
    from RL2.config.ppo_schema import PPOConfig

    for argv, message in ((["actor.lora.rank=-2"], "actor.lora.rank=-2; set a positive rank"),
                          (["actor.lora.dropout=1.0"], "actor.lora.dropout=1.0; it must be in [0, 1)"),
                          (["critic.lora.rank=8", "critic.lora.alpha=0"], "critic.lora.alpha=0.0; it must be positive"),
                          (["actor.lora.rank=8", "actor.lora.target_modules=[]"],
                           "actor.lora.target_modules is empty")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(PPOConfig, "ppo", argv)
    parse_config(PPOConfig, "ppo", ["critic.lora.alpha=0"])  # unused while the critic trains every parameter


def test_adapter_starts_at_the_base_and_computes_the_merged_weight():
    base = nn.Linear(6, 5)
    layer = LoRALinear(base, rank=3, alpha=6.0, dropout=0.0)
    x = torch.randn(4, 6)
    torch.testing.assert_close(layer(x), base(x))  # B starts at zero
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    w = base.weight + 2.0 * layer.lora_B.weight @ layer.lora_A.weight
    torch.testing.assert_close(layer(x), F.linear(x, w, base.bias))
    with adapters_disabled(layer):
        torch.testing.assert_close(layer(x), base(x))
    assert [n for n, p in layer.named_parameters()] == ["base_layer.weight", "base_layer.bias", "lora_A.weight",
                                                        "lora_B.weight"]


def test_only_adapters_and_a_scalar_head_train():
    model = tiny_llama()
    wrapped = add_adapters(model, list(model.model.layers), RANK, ALPHA, 0.0, ["q_proj", "mlp.down_proj"])
    assert wrapped == [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp.down_proj", "self_attn.q_proj")]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{path}.lora_{ab}.weight" for path in wrapped for ab in "AB"}
    config = tiny_llama().config
    config.num_labels = 1
    head = AutoModelForTokenClassification.from_config(config)
    add_adapters(head, list(head.model.layers), RANK, ALPHA, 0.0, ["all-linear"])
    trained = {n for n, p in head.named_parameters() if p.requires_grad}
    assert {n for n in trained if "lora_" not in n} == {"score.weight", "score.bias"}
    assert len(trained) == 2 + 2 * 7 * 2 and head.score.weight.dtype == torch.float32
    with pytest.raises(ValueError, match=r"lora.target_modules=\['qkv'\] matches no linear layer .* q_proj"):
        add_adapters(tiny_llama(), list(tiny_llama().model.layers), RANK, ALPHA, 0.0, ["qkv"])


def test_engine_stream_and_export_merge_base_plus_scaled_ba():
    model = with_adapters(tiny_llama())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    base_names = list(tiny_llama().state_dict())
    merged, adapter = split_for_export(state, SCALE)
    assert list(merged) == base_names  # the base model's names, in its order
    base_state = {k.replace(".base_layer.", "."): v for k, v in state.items() if "lora_" not in k}
    expected = expected_merge(base_state, adapter, SCALE)
    for key in base_names:
        torch.testing.assert_close(merged[key], expected[key])
    streamed = dict(merge_adapters(((n, p.detach()) for n, p in model.named_parameters()), SCALE))
    assert set(streamed) == {n for n, _ in tiny_llama().named_parameters()}
    for key, value in streamed.items():
        torch.testing.assert_close(value, expected[key])
    reference = tiny_llama()  # the merged weights compute what the adapted model computes
    reference.load_state_dict(merged)
    ids = torch.randint(0, 64, (1, 7))
    torch.testing.assert_close(reference(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_merging_into_the_base_keeps_the_model_and_moves_the_base():
    """ProRL's reset under LoRA: alpha of the adapters moves into the base (the reference)."""
    model = with_adapters(tiny_llama())
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        before = model(ids).logits
        expected_base = {}
        for name, module in model.named_modules():
            if isinstance(module, LoRALinear):
                delta = module.lora_B.weight @ module.lora_A.weight
                expected_base[name] = module.base_layer.weight + 0.25 * SCALE * delta
    merge_into_base(model, 0.25)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=1e-5)
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            torch.testing.assert_close(module.base_layer.weight, expected_base[name])
