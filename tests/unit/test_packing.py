"""Balanced, padding-free packing, and attention that never crosses a sequence boundary."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import RL2.models.attention  # noqa: F401
from RL2.batch import SequenceBatch
from RL2.config import ConfigError
from RL2.models.chunked_logps import token_logps
from RL2.models.logps import forward_packed
from RL2.packing import balanced_partition, pack, plan_micro_batches, train_weights


def random_examples(n, seed=0, low=3, high=40):
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = rng.randint(low, high)
        prompt = rng.randint(1, length - 2)
        examples.append({
            "input_ids": [rng.randint(0, 999) for _ in range(length)],
            "loss_mask": [0] * prompt + [1] * (length - prompt),
        })
    return examples


def test_balanced_partition_follows_longest_first_greedy():
    sizes = [10, 9, 8, 7, 6, 5, 4]
    parts = balanced_partition(sizes, 2)
    # By hand: 10->A, 9->B, 8->B(17), 7->A(17), 6->A(23), 5->B(22), 4->B(26)
    assert sorted(sorted(p) for p in parts) == [[0, 3, 4], [1, 2, 5, 6]]
    assert balanced_partition([5, 5, 5, 5], 4) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_plan_covers_every_example_once_within_budget(dp_size):
    sizes = [len(ex["input_ids"]) - 1 for ex in random_examples(37)]
    plan = plan_micro_batches(sizes, dp_size, max_tokens=100)
    assert len({len(rank) for rank in plan}) == 1  # same number of micro-batches on every rank
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(37))
    assert all(sum(sizes[i] for i in mb) <= 100 for rank in plan for mb in rank)
    loads = [sum(sizes[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= max(sizes)


def test_too_long_sequence_is_a_clear_error():
    with pytest.raises(ConfigError, match="actor.max_length_per_device=10"):
        plan_micro_batches([5, 11], 1, max_tokens=10)


def test_a_pair_too_long_together_is_called_a_pair():
    """A DPO pair (29 + 24 labels) whose sides each fit actor.max_length_per_device=40 but not together: no
    sequence of 53 tokens exists, the pair holds them."""
    batch = SequenceBatch(input_ids=[[1] * 30, [2] * 25], tokens={"loss_mask": torch.ones(53)})
    with pytest.raises(ConfigError, match=r"^2 sequences that must share a micro-batch \(e.g. a preference pair's two "
                                          r"sides\) hold 53 tokens together, which do not fit in "
                                          r"actor.max_length_per_device=40; raise actor.max_length_per_device"):
        pack(batch, 0, 1, max_tokens=40, units=[[0, 1]])


def test_a_sequence_too_long_for_the_critic_names_the_critics_key(tiny_model_path, one_rank):
    """PPO's critic packs with its own budget, which may be below the actor's: its error names critic.*."""
    from omegaconf import OmegaConf

    from RL2.batch import RolloutBatch
    from RL2.config.ppo_schema import CriticConfig
    from RL2.parallel import ParallelDims
    from RL2.workers.critic import Critic

    cfg = OmegaConf.merge(OmegaConf.structured(CriticConfig), {"model_name": tiny_model_path, "dtype": "float32",
                                                                "max_length_per_device": 8})
    critic = Critic(cfg, ParallelDims(1), torch.device("cpu"), total_steps=1)
    batch = RolloutBatch.single_turn([{"input_ids": list(range(20)), "loss_mask": [0] * 5 + [1] * 15}], [0])
    with pytest.raises(ConfigError, match=r"a sequence of 19 tokens does not fit in critic.max_length_per_device=8; "
                                          r"raise critic.max_length_per_device"):
        critic.values(batch)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_sum_to_one_over_all_ranks(level):
    batch = SequenceBatch.from_examples(random_examples(11))
    weights = train_weights(batch, level)
    total, seen = 0.0, []
    for rank in range(2):
        for mb in pack(batch, rank, 2, max_tokens=64, weights=weights):
            total += mb.loss_weights.sum().item()
            assert torch.all((mb.loss_weights > 0) == (mb.loss_mask > 0))
            seen += mb.sequence_ids
    assert total == pytest.approx(1.0) and sorted(seen) == list(range(11))
    if level == "sequence":  # each sequence's weights sum to 1/n
        assert [batch.sequence("loss_mask", i) @ weights[batch.offsets[i] : batch.offsets[i + 1]]
                for i in range(11)] == pytest.approx([1 / 11] * 11)


def test_packed_tensors_and_empty_bins():
    batch = SequenceBatch(input_ids=[[1, 2, 3], [4, 5]],
                          tokens={"loss_mask": torch.tensor([1.0, 1.0, 1.0]), "adv": torch.tensor([0.5, 0.7, 0.9])})
    (mb,) = pack(batch, 0, 1, max_tokens=8)
    assert mb.input_ids.tolist() == [[1, 2, 4]]
    assert mb.labels.tolist() == [[2, 3, 5]]
    assert mb.position_ids.tolist() == [[0, 1, 0]]
    assert mb.cu_seqlens.tolist() == [0, 2, 3]
    torch.testing.assert_close(mb.extras["adv"], torch.tensor([[0.5, 0.7, 0.9]]))
    assert [t.tolist() for t in mb.unpack(mb.labels)] == [[2, 3], [5]]
    # 2 sequences on 3 ranks: the third rank gets a dummy micro-batch with zero weight
    (empty,) = pack(batch, 2, 3, max_tokens=8)
    assert empty.sequence_ids == [] and empty.loss_weights.sum() == 0


def test_examples_become_label_aligned_sequences():
    batch = SequenceBatch.from_examples([{"input_ids": [7, 8, 9], "loss_mask": [0, 0, 1]},
                                         {"input_ids": [5, 6], "loss_mask": [1, 1]}])
    assert batch.tokens["loss_mask"].tolist() == [0.0, 1.0, 1.0]  # token 0 is never a label
    assert batch.offsets.tolist() == [0, 2, 3] and batch.n_samples == 2


@pytest.fixture(scope="module")
def tiny_qwen2_path(tmp_path_factory, tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_logits_equal_per_sequence_logits(family, tiny_model_path, tiny_qwen2_path):
    path = tiny_model_path if family == "llama" else tiny_qwen2_path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="rl2_varlen")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    examples = random_examples(6, seed=3)
    (mb,) = pack(SequenceBatch.from_examples(examples), 0, 1, max_tokens=1000)
    with torch.no_grad():
        packed = forward_packed(model, mb).logits
        for example, logits in zip(examples, mb.unpack(packed)):
            alone = reference(input_ids=torch.tensor([example["input_ids"][:-1]])).logits[0]
            torch.testing.assert_close(logits, alone, atol=1e-4, rtol=1e-4)
        # and the same through the plain per-token log-probabilities
        logps = token_logps(packed, mb.labels)
        direct = packed.log_softmax(-1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(logps, direct)


def test_capped_attention_scores_are_the_models_own(tmp_path):
    """Gemma 2 caps attention scores (cap * tanh(scores / cap)), which SDPA cannot apply: packed rows
    must still give the logits of the model's own eager attention, sequence by sequence."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                          num_attention_heads=4, num_key_value_heads=2, attn_logit_softcapping=1.0,
                          query_pre_attn_scalar=16, initializer_range=0.2)  # large weights: the cap bites
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="rl2_varlen")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    examples = random_examples(4, seed=5)
    (mb,) = pack(SequenceBatch.from_examples(examples), 0, 1, max_tokens=1000)
    with torch.no_grad():
        for example, logits in zip(examples, mb.unpack(forward_packed(model, mb).logits)):
            alone = reference(input_ids=torch.tensor([example["input_ids"][:-1]])).logits[0]
            torch.testing.assert_close(logits, alone, atol=1e-4, rtol=1e-4)


def test_a_sequence_past_a_sliding_window_is_refused_not_scored_wrongly(tok, tmp_path):
    """RL2's packed attention attends to the whole sequence: within a Mistral's window that is the
    model's own attention; past it, log-probabilities would not be the model's."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config

    from RL2.models.attention import sliding_window_of
    from RL2.models.logps import ModelLayout

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="rl2_varlen")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    model.parallel_layout = ModelLayout(sliding_window=sliding_window_of(model.config))
    assert model.parallel_layout.sliding_window == 8
    within = [{"input_ids": list(range(100, 109)), "loss_mask": [0] * 3 + [1] * 6}]  # 8 positions scored
    (mb,) = pack(SequenceBatch.from_examples(within), 0, 1, max_tokens=100)
    with torch.no_grad():
        torch.testing.assert_close(forward_packed(model, mb).logits[0],
                                   reference(input_ids=mb.input_ids).logits[0], atol=1e-4, rtol=1e-4)
    past = [{"input_ids": list(range(100, 110)), "loss_mask": [0] * 3 + [1] * 7}]
    (mb,) = pack(SequenceBatch.from_examples(past), 0, 1, max_tokens=100)
    with pytest.raises(NotImplementedError, match=r"sequence of 9 tokens is longer than the model's attention "
                                                  r"window \(sliding_window=8\)"):
        forward_packed(model, mb)
    assert sliding_window_of(Qwen2Config(sliding_window=4096, use_sliding_window=False)) is None
    from RL2.engine.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(reference.eval(), tok)  # samples no further than its attention is the model's
    try:
        assert engine.context_len == 8
    finally:
        engine.shutdown()
