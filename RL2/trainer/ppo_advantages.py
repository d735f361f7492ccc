"""From scored trajectories to what the policy update reads: rewards with their shaping and
reward-model scores, KL penalties in the reward, and each estimator's per-token advantages.

The examples are the trainer's per-trajectory dicts (per-token lists aligned with `input_ids`); the
estimators themselves are the pure tensor functions of `RL2.algs.advantages`.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from RL2.algs.advantages import (
    broadcast_turns_to_tokens,
    compute_advantages,
    expand_to_tokens,
    masked_whiten,
    outcome_to_token_rewards,
)
from RL2.algs.kl import compute_kl
from RL2.algs.reward_shaping import length_penalty, overlong_penalty


def padded(examples: list[dict], key: str) -> torch.Tensor:
    """`[B, T]` float tensor of a per-token key, aligned with the actions (index t+1 of the lists)."""
    width = max(len(ex["input_ids"]) - 1 for ex in examples)
    return torch.tensor([ex[key][1:] + [0.0] * (width + 1 - len(ex[key])) for ex in examples], dtype=torch.float32)


@dataclass
class RolloutTensors:
    """What the advantage estimators read, padded `[B, T]` (token level) or `[B]` (trajectory level)."""

    mask: torch.Tensor
    scores: torch.Tensor  # outcome reward, minus the summed KL when the KL goes into the reward
    token_rewards: torch.Tensor  # each turn's reward on its last action token, minus the per-token KL
    group_ids: torch.Tensor
    values: torch.Tensor | None
    turn_rewards: torch.Tensor  # [B, K] each turn's reward (0 on padding turns)
    turn_mask: torch.Tensor  # [B, K] 1.0 on real turns
    turn_ids: torch.Tensor  # [B, T] the turn of each action token, -1 elsewhere


def shape_rewards(examples: list[dict], rollout_cfg) -> dict[str, float]:
    """Add DAPO's overlong penalty and the length penalty (when on) to each example's reward and to
    its last turn's reward; both read the trajectory's sampled tokens against `max_new_tokens`."""
    budget = rollout_cfg.train_sampling_params.max_new_tokens
    lengths = torch.tensor([ex["response_length"] for ex in examples])
    shaping, metrics = torch.zeros(len(examples)), {}
    if rollout_cfg.overlong_buffer_len:
        penalty = overlong_penalty(lengths, budget, rollout_cfg.overlong_buffer_len, rollout_cfg.overlong_penalty_factor)
        shaping += penalty
        metrics["rollout/overlong_penalty"] = penalty.mean().item()
    if rollout_cfg.length_penalty_coef:
        penalty = length_penalty(lengths, rollout_cfg.length_penalty_coef, budget)
        shaping += penalty
        metrics["rollout/length_penalty"] = penalty.mean().item()
    if metrics:
        for example, extra in zip(examples, shaping.tolist()):
            example["reward"] += extra
            example["turn_rewards"][-1] += extra
    return metrics


def add_reward_model_scores(examples: list[dict], scores: list[float]) -> dict[str, float]:
    """Add each example's reward-model score to its reward and to its last turn's reward."""
    for example, score in zip(examples, scores):
        example["reward"] += score
        example["turn_rewards"][-1] += score
    return {"rollout/reward_model_score": sum(scores) / len(scores)}


def rollout_tensors(examples: list[dict], kl_cfg, teacher_coef: float = 0.0) -> RolloutTensors:
    """Args: kl_cfg: `actor.kl`; teacher_coef: weight of the teacher's reverse KL when `teacher_logps` are given."""
    mask = padded(examples, "loss_mask")
    scores = torch.tensor([float(ex["reward"]) for ex in examples])
    kl = torch.zeros_like(mask)
    if kl_cfg.coef > 0 and kl_cfg.type == "reward":
        kl = kl_cfg.coef * compute_kl(kl_cfg.estimator, padded(examples, "old_logps"), padded(examples, "ref_logps")) * mask
    if "teacher_logps" in examples[0]:
        # On-policy distillation: log p_actor - log p_teacher at each sampled token is a one-sample
        # estimate of the reverse KL(actor || teacher); as a penalty it pulls the actor to the teacher.
        kl = kl + teacher_coef * compute_kl("k1", padded(examples, "old_logps"), padded(examples, "teacher_logps")) * mask
    return RolloutTensors(
        mask=mask,
        scores=scores - kl.sum(-1),
        token_rewards=turn_end_rewards(examples, mask) - kl,
        group_ids=torch.tensor([ex["group"] for ex in examples]),
        values=padded(examples, "values") if "values" in examples[0] else None,
        **turn_tensors(examples, mask),
    )


def turn_tensors(examples: list[dict], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-turn rewards `[B, K]`, their mask and each action token's turn `[B, T]`, for `mc`."""
    per_turn = [ex.get("turn_rewards", [float(ex["reward"])]) for ex in examples]  # one turn when not recorded
    n_turns = max(len(rewards) for rewards in per_turn)
    turn_rewards, turn_mask = torch.zeros(len(examples), n_turns), torch.zeros(len(examples), n_turns)
    turn_ids = torch.full(mask.shape, -1, dtype=torch.long)
    for i, (example, rewards) in enumerate(zip(examples, per_turn)):
        turn_rewards[i, : len(rewards)], turn_mask[i, : len(rewards)] = torch.tensor(rewards, dtype=torch.float32), 1.0
        ids = example.get("turn_ids") or [-1] + [0 if m else -1 for m in example["loss_mask"][1:]]
        turn_ids[i, : len(ids) - 1] = torch.tensor(ids[1:])
    return {"turn_rewards": turn_rewards, "turn_mask": turn_mask, "turn_ids": turn_ids}


def monte_carlo_advantages(adv_cfg, t: RolloutTensors) -> torch.Tensor:
    """`mc`: each action token gets the (truncated, discounted) return from its turn on."""
    returns = compute_advantages("mc", turn_rewards=t.turn_rewards, turn_mask=t.turn_mask,
                                 gamma=adv_cfg.gamma, truncation=adv_cfg.truncation)
    advantages = broadcast_turns_to_tokens(returns, t.turn_ids) * t.mask
    return masked_whiten(advantages, t.mask) * t.mask if adv_cfg.global_norm else advantages


def turn_end_rewards(examples: list[dict], mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]`: each turn's reward on the last action token of that turn, so that the token-level
    estimators (gae, reinforce_plus_plus) see when a multi-turn reward arrived. Examples without turn
    records get their outcome reward on their last action token."""
    if "turn_ids" not in examples[0]:
        return outcome_to_token_rewards(torch.tensor([float(ex["reward"]) for ex in examples]), mask)
    rewards = torch.zeros_like(mask)
    for i, example in enumerate(examples):
        last_token = {turn: t for t, turn in enumerate(example["turn_ids"][1:]) if turn >= 0}
        for turn, t in last_token.items():
            rewards[i, t] = example["turn_rewards"][turn]
    return rewards


# adv.estimator -> (adv config, tensors) -> (token advantages, returns or None). The estimators are
# the pure functions of RL2.algs.advantages; this only says which inputs each one reads.
ADVANTAGES: dict[str, Callable] = {
    "gae": lambda a, t: compute_advantages("gae", rewards=t.token_rewards, values=t.values, mask=t.mask,
                                           gamma=a.gamma, lamda=a.lamda),
    "reinforce": lambda a, t: (expand_to_tokens(compute_advantages(
        "reinforce", scores=t.scores, group_ids=t.group_ids, norm_var=a.norm_var, global_norm=a.global_norm), t.mask), None),
    "rloo": lambda a, t: (expand_to_tokens(compute_advantages("rloo", scores=t.scores, group_ids=t.group_ids), t.mask), None),
    "reinforce_plus_plus": lambda a, t: (compute_advantages(
        "reinforce_plus_plus", rewards=t.token_rewards, mask=t.mask, gamma=a.gamma), None),
    "raw": lambda a, t: (expand_to_tokens(compute_advantages("raw", scores=t.scores), t.mask), None),
    "mc": lambda a, t: (monte_carlo_advantages(a, t), None),
}


def add_advantages(examples: list[dict], adv_cfg, kl_cfg, teacher_coef: float = 0.0) -> dict[str, float]:
    """Write per-token `advantages` (and `returns` for gae) into the examples; returns adv/* metrics."""
    tensors = rollout_tensors(examples, kl_cfg, teacher_coef)
    advantages, returns = ADVANTAGES[adv_cfg.estimator](adv_cfg, tensors)
    for i, example in enumerate(examples):
        n = len(example["input_ids"]) - 1
        example["advantages"] = [0.0] + advantages[i, :n].tolist()
        if returns is not None:
            example["returns"] = [0.0] + returns[i, :n].tolist()
    mask = tensors.mask
    values = advantages[mask > 0]
    metrics = {"adv/mean": values.mean().item(), "adv/std": values.std().item() if values.numel() > 1 else 0.0}
    if "teacher_logps" in examples[0]:
        reverse_kl = padded(examples, "old_logps") - padded(examples, "teacher_logps")
        metrics["actor/teacher_kl"] = reverse_kl[mask > 0].mean().item()
    if "ref_logps" in examples[0]:  # the KL to the reference of the policy that sampled (engine log-probs)
        ref_kl = compute_kl(kl_cfg.estimator, padded(examples, "engine_logps"), padded(examples, "ref_logps"))
        metrics["actor/ref_kl"] = ref_kl[mask > 0].mean().item()
    return metrics
