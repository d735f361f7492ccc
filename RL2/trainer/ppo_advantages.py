"""From a scored rollout to what the policy update reads: shaped rewards, KL penalties in the reward, and each
estimator's per-token advantages (the tensor functions of `RL2.algs.advantages`). A trajectory is one sample
however many sequences it spans: grpo, rloo and raw score it once, gae and reinforce_plus_plus run over its
action tokens in one row, mc over its turns; a faulted one has no tokens and no part in its group's baseline."""

from collections.abc import Callable

import torch
from torch import Tensor

from RL2.algs.advantages import gae, grpo, masked_whiten, mc, reinforce_plus_plus, rloo
from RL2.algs.kl import compute_kl
from RL2.algs.reward_shaping import length_penalty, overlong_penalty
from RL2.batch import RolloutBatch


def shape_rewards(batch: RolloutBatch, rollout_cfg) -> dict[str, float]:
    """Add DAPO's overlong penalty and the length penalty (when on) to each trajectory's reward, once."""
    budget, penalties = rollout_cfg.train_sampling_params.max_new_tokens, {}
    if rollout_cfg.overlong_buffer_len:
        penalties["overlong_penalty"] = overlong_penalty(
            batch.response_lengths, budget, rollout_cfg.overlong_buffer_len, rollout_cfg.overlong_penalty_factor)
    if rollout_cfg.length_penalty_coef:
        penalties["length_penalty"] = length_penalty(batch.response_lengths, rollout_cfg.length_penalty_coef, budget)
    if penalties:
        batch.add_rewards(sum(penalties.values()))
    return {f"rollout/{name}": penalty.mean().item() for name, penalty in penalties.items()}


def add_reward_model_scores(batch: RolloutBatch, scores: Tensor) -> dict[str, float]:
    """Add each trajectory's reward-model score (`[n_samples]`) to its reward, once."""
    batch.add_rewards(scores)
    return {"rollout/reward_model_score": scores.mean().item()}


def reward_penalties(batch: RolloutBatch, kl_cfg, teacher_coef: float = 0.0) -> Tensor:
    """`[n_labels]` per-token penalties subtracted from the reward: the KL to the reference when it goes
    into the reward, and on-policy distillation's reverse KL to the teacher."""
    mask = batch.tokens["loss_mask"]
    penalties = torch.zeros_like(mask)
    if kl_cfg.coef > 0 and kl_cfg.type == "reward":
        penalties += kl_cfg.coef * compute_kl(kl_cfg.estimator, batch.tokens["old_logps"], batch.tokens["ref_logps"])
    if "teacher_logps" in batch.tokens:
        # log p_actor - log p_teacher at each sampled token is a one-sample estimate of the reverse
        # KL(actor || teacher); as a penalty it pulls the actor to the teacher.
        penalties += teacher_coef * compute_kl("k1", batch.tokens["old_logps"], batch.tokens["teacher_logps"])
    return penalties * mask


def turn_end_rewards(batch: RolloutBatch) -> Tensor:
    """`[n_labels]`: each turn's reward on the last sampled token of that turn, so that the token-level
    estimators see when a multi-turn reward arrived."""
    keys, positions = _turn_keys(batch)
    last = torch.full((batch.turn_rewards.numel(),), -1, dtype=torch.long)
    last = last.scatter_reduce(0, keys, positions, reduce="amax")
    has_tokens = last >= 0
    rewards = torch.zeros(batch.n_labels)
    rewards[last[has_tokens]] = batch.turn_rewards.flatten()[has_tokens]
    return rewards


def _turn_keys(batch: RolloutBatch) -> tuple[Tensor, Tensor]:
    """(trajectory * K + turn, label position) of every sampled token."""
    turn_ids = batch.tokens["turn_ids"]
    positions = (turn_ids >= 0).nonzero()[:, 0]
    keys = batch.sample_of_label[positions] * batch.turn_rewards.shape[1] + turn_ids[positions]
    return keys, positions


# ---- the estimators over a rollout: (batch, adv config, penalties) -> (advantages, returns or None) ----


def _trajectory_level(batch: RolloutBatch, advantages: Tensor) -> Tensor:
    """`[n_samples]` -> `[n_labels]`: every sampled token of a trajectory gets its advantage."""
    return advantages[batch.sample_of_label] * batch.tokens["loss_mask"]


def grpo_advantages(batch, adv_cfg, penalties):
    # adv.baseline=batch: the whole batch is one group (REINFORCE with the batch mean as baseline).
    shape = (1, -1) if adv_cfg.baseline == "batch" else (batch.n_groups, batch.group_size)
    scores = batch.rewards - batch.sample_sums(penalties)
    advantages = grpo(scores.view(shape), adv_cfg.norm_var, batch.trained.view(shape))
    return _trajectory_level(batch, advantages.flatten()), None


def rloo_advantages(batch, adv_cfg, penalties):
    shape = (batch.n_groups, batch.group_size)  # each prompt's trajectories
    advantages = rloo((batch.rewards - batch.sample_sums(penalties)).view(shape), batch.trained.view(shape))
    return _trajectory_level(batch, advantages.flatten()), None


def raw_advantages(batch, adv_cfg, penalties):
    return _trajectory_level(batch, batch.rewards - batch.sample_sums(penalties)), None


def gae_advantages(batch, adv_cfg, penalties):
    rows = batch.sample_rows
    advantages, returns = gae(rows(turn_end_rewards(batch) - penalties), rows(batch.tokens["values"]),
                              rows(batch.tokens["loss_mask"]), adv_cfg.gamma, adv_cfg.lamda)
    return batch.from_sample_rows(advantages), batch.from_sample_rows(returns)


def reinforce_plus_plus_advantages(batch, adv_cfg, penalties):
    rows = batch.sample_rows
    advantages = reinforce_plus_plus(rows(turn_end_rewards(batch) - penalties), rows(batch.tokens["loss_mask"]),
                                     adv_cfg.gamma)
    return batch.from_sample_rows(advantages), None


def monte_carlo_advantages(batch, adv_cfg, penalties):
    """Each sampled token's (truncated, discounted) return from its turn on; a turn's penalties count in its reward."""
    keys, positions = _turn_keys(batch)
    turn_penalties = torch.zeros(batch.turn_rewards.numel()).index_add_(0, keys, penalties[positions])
    returns = mc(batch.turn_rewards - turn_penalties.view_as(batch.turn_rewards), batch.turn_mask, adv_cfg.gamma,
                 adv_cfg.truncation)
    turn_ids = batch.tokens["turn_ids"]
    per_token = returns[batch.sample_of_label, turn_ids.clamp(min=0)] * (turn_ids >= 0)
    return per_token * batch.tokens["loss_mask"], None


# adv.estimator -> the function above; its choices in RL2/config/ppo_schema.py are these names (test_registries.py).
ESTIMATORS: dict[str, Callable] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "raw": raw_advantages,
    "mc": monte_carlo_advantages,
}


def add_advantages(batch: RolloutBatch, adv_cfg, kl_cfg, teacher_coef: float = 0.0) -> dict[str, float]:
    """Write per-token `advantages` (and `returns` for gae) into the batch; returns adv/* metrics."""
    mask = batch.tokens["loss_mask"]
    advantages, returns = ESTIMATORS[adv_cfg.estimator](batch, adv_cfg, reward_penalties(batch, kl_cfg, teacher_coef))
    if adv_cfg.global_norm:
        advantages = masked_whiten(advantages, mask)
    batch.tokens["advantages"] = advantages * mask
    if returns is not None:
        batch.tokens["returns"] = returns * mask
    sampled = advantages[mask > 0]
    metrics = {"adv/mean": sampled.mean().item(), "adv/std": sampled.std().item() if sampled.numel() > 1 else 0.0}
    if "teacher_logps" in batch.tokens:
        reverse_kl = batch.tokens["old_logps"] - batch.tokens["teacher_logps"]
        metrics["actor/teacher_kl"] = reverse_kl[mask > 0].mean().item()
    if "ref_logps" in batch.tokens:  # the KL to the reference of the policy that sampled (engine log-probs)
        ref_kl = compute_kl(kl_cfg.estimator, batch.tokens["engine_logps"], batch.tokens["ref_logps"])
        metrics["actor/ref_kl"] = ref_kl[mask > 0].mean().item()
    return metrics
