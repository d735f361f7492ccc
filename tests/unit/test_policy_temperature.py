"""Rollouts at a sampling temperature T sample from softmax(logits / T), and that is the policy the actor
trains: its log-probabilities, its reference's and the gradient of its whole loss (clipped ratio, KL to
the reference, truncated importance weights, entropy bonus) at T = 0.7, against the models' own forward
with their logits divided by T and the loss written out by hand."""

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from RL2.batch import RolloutBatch
from RL2.config.cli import parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.parallel import ParallelDims
from RL2.workers.actor import Actor
from tests.helpers.tiny import make_tiny_model

T = 0.7
CLIP, KL_COEF, ENTROPY_COEF, TIS_COEF = 0.2, 0.1, 0.01, 1.5


def rollout(vocab: int) -> RolloutBatch:
    """Two groups of two responses of varied lengths after short prompts."""
    generator = torch.Generator().manual_seed(0)
    examples = []
    for prompt_len, response_len in ((5, 4), (5, 7), (8, 3), (8, 6)):
        ids = torch.randint(0, vocab, (prompt_len + response_len,), generator=generator).tolist()
        examples.append({"input_ids": ids, "loss_mask": [0] * prompt_len + [1] * response_len})
    return RolloutBatch.single_turn(examples, [0, 0, 1, 1], [1.0, 0.0, 0.0, 1.0])


def at_temperature(model, batch: RolloutBatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sequence's log-probabilities of its labels and entropies under softmax(logits / T), from the
    model's own forward of that sequence alone."""
    logps, entropies = [], []
    for ids in batch.input_ids:
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float() / T, -1)
        logps.append(log_probs.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
        entropies.append(-(log_probs.exp() * log_probs).sum(-1))
    return logps, entropies


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("reference"), seed=3)  # other weights: a KL that pulls


def test_actor_loss_gradient_is_that_of_the_tempered_policy(tiny_model_path, reference_model, one_rank):
    cfg = parse_config(PPOConfig, "ppo", [
        f"actor.model_name={tiny_model_path}", "actor.dtype=float32", "actor.max_length_per_device=64",
        f"actor.clip={CLIP}", f"actor.kl.coef={KL_COEF}", "actor.kl.estimator=k3", f"actor.entropy.coef={ENTROPY_COEF}",
        f"actor.tis_coef={TIS_COEF}", "actor.max_grad_norm=0", f"rollout.train_sampling_params.temperature={T}"])
    dims, cpu = ParallelDims(1), torch.device("cpu")
    actor = Actor(cfg.actor, dims, cpu, total_steps=1, temperature=T)
    ref = Actor(cfg.actor, dims, cpu, train=False, model_name=reference_model, temperature=T)
    batch = rollout(actor.model.config.vocab_size)
    mask = batch.tokens["loss_mask"]

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(reference_model, dtype=torch.float32)
    with torch.no_grad():
        ref_logps = torch.cat(at_temperature(reference, batch)[0]) * mask
        initial_logps = torch.cat(at_temperature(policy, batch)[0]) * mask
    # The trainer's log-probabilities are the tempered policy's, the policy's and the reference's alike.
    torch.testing.assert_close(actor.logps(batch), initial_logps, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref.logps(batch), ref_logps, atol=1e-5, rtol=0)

    # A rollout whose policy has moved since (old log-probs), sampled by an engine a little off the
    # trainer (engine log-probs): ratios away from 1, some clipped, importance weights some capped.
    noise = lambda seed: torch.randn(batch.n_labels, generator=torch.Generator().manual_seed(seed))
    old_logps = (initial_logps + 0.2 * noise(1)) * mask
    engine_logps = (old_logps + 0.3 * noise(2)) * mask
    advantages = noise(3) * mask
    batch.tokens |= {"old_logps": old_logps, "engine_logps": engine_logps, "ref_logps": ref_logps,
                     "advantages": advantages}

    # The loss by hand, per token, averaged over the batch's trained tokens (actor.avg_level=token).
    logps, entropies = at_temperature(policy, batch)
    logps, entropy = torch.cat(logps), torch.cat(entropies)
    ratio = torch.exp(logps - old_logps)
    surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP, 1 + CLIP))
    tis = torch.exp(old_logps - engine_logps).clamp(max=TIS_COEF)
    log_ratio = ref_logps - logps
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    loss = ((surrogate * tis + KL_COEF * k3 - ENTROPY_COEF * entropy) * mask).sum() / mask.sum()
    loss.backward()
    expected = dict(policy.named_parameters())

    gradients = {}
    step = actor.worker.optimizer_step

    def capture_gradients():
        gradients.update({name: full(p.grad).clone() for name, p in actor.model.named_parameters()})
        return step()

    actor.worker.optimizer_step = capture_gradients
    metrics = actor.update(batch)
    assert gradients.keys() == expected.keys()
    for name, grad in gradients.items():
        torch.testing.assert_close(grad, expected[name].grad, atol=1e-6, rtol=1e-4, msg=name)
    assert metrics["actor/entropy"] == pytest.approx(float((entropy.detach() * mask).sum() / mask.sum()), abs=1e-5)
    assert metrics["actor/kl"] == pytest.approx(float((k3.detach() * mask).sum() / mask.sum()), abs=1e-5)
    # old_logps here are not the current policy's, so the mismatch is that of the hand-made engine_logps.
    assert metrics["actor/engine_mismatch"] == pytest.approx(float(((old_logps - engine_logps).abs() * mask).sum()
                                                                   / mask.sum()), abs=1e-5)
