"""RL with verifiable rewards: `torchrun -m RL2.trainer.ppo data.train.path=rl.jsonl rollout.env_path=envs/x.py`.

One step: roll out every prompt `rollout.responses_per_prompt` times (each rank its share, on its
own embedded engine), score the trajectories with the environment, compute reference log-probs
(KL), values (PPO's critic) and old log-probs when needed, turn rewards into advantages with the
estimator named by `adv.estimator` (GRPO: `reinforce`; PPO: `gae`), update the actor (and critic),
and copy the new weights into the engines.
"""

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from RL2.algs.advantages import compute_advantages, expand_to_tokens, outcome_to_token_rewards
from RL2.algs.kl import compute_kl
from RL2.config.ppo_schema import PPOConfig, check_ppo_choices
from RL2.datasets.splits import EpochSampler, load_splits
from RL2.datasets.tokenize import BadRow, prompt_messages, require_text
from RL2.rollout.rollout import filter_groups, rollout_metrics, save_samples
from RL2.rollout.trajectory import Trajectory
from RL2.trainer.base import Trainer, launch
from RL2.utils.logging import is_rank0
from RL2.models.logps import forward_packed
from RL2.workers.actor import Actor, n_mini_batches, per_token_pass
from RL2.workers.critic import Critic
from RL2.workers.fsdp import load_tokenizer, scalar_head_worker
from RL2.workers.rollout_worker import RolloutWorker, rollout_seed


class PPOTrainer(Trainer):
    def __init__(self, cfg):
        check_ppo_choices(cfg)
        super().__init__(cfg, cfg.actor)
        self.tokenizer = load_tokenizer(cfg.actor)
        self.train_data, self.test_data = load_splits(cfg.data, prompt_row_tokenizer(self.tokenizer), cfg.trainer.seed)
        self.sampler = EpochSampler(len(self.train_data), cfg.data.train.batch_size, cfg.data.shuffle, cfg.trainer.seed)
        self.n_steps = self.total_steps(self.sampler.steps_per_epoch)
        self._build_workers()

    def _build_workers(self) -> None:
        cfg, args = self.cfg, (self.dims, self.device)
        budget = cfg.rollout.train_sampling_params.max_new_tokens  # the normaliser of avg_level=constant
        self.actor = Actor(cfg.actor, *args, self.optimizer_steps(cfg.actor), constant=budget)
        self.ref = Actor(cfg.actor, *args, train=False) if cfg.actor.kl.coef > 0 else None
        teacher = cfg.actor.teacher.model_name
        self.teacher = Actor(cfg.actor, *args, train=False, model_name=teacher) if teacher else None
        self.reward_model = scalar_head_worker(cfg.critic, *args, train=False, model_name=cfg.rollout.reward_model) if (
            cfg.rollout.reward_model) else None
        self.critic = Critic(cfg.critic, *args, self.optimizer_steps(cfg.critic), constant=budget) if (
            cfg.adv.estimator == "gae") else None
        self.rollout = RolloutWorker(cfg.rollout, cfg.actor, self.tokenizer, self.device)

    def optimizer_steps(self, model_cfg) -> int:
        per_rollout = model_cfg.update_per_rollout * n_mini_batches(self.cfg.data.train.batch_size, model_cfg.mini_batch_size)
        return self.n_steps * per_rollout

    def workers(self) -> dict:
        return {"actor": self.actor.worker} | ({"critic": self.critic.worker} if self.critic else {})

    def train(self) -> None:
        self.run(self.n_steps)

    def train_step(self, step: int) -> dict[str, float]:
        cfg, metrics = self.cfg, {}
        with timed(metrics, "perf/rollout_s"):
            prompts = [self.train_data[i] for i in self.sampler.batch(step - 1)]
            groups = self.rollout.rollout(prompts, cfg.rollout.train_sampling_params, cfg.rollout.responses_per_prompt,
                                          rollout_seed(cfg.trainer.seed, step, dist.get_rank()))
        metrics |= rollout_metrics(groups)
        if cfg.rollout.save_samples and is_rank0():
            save_samples(f"{cfg.trainer.save_dir}/samples.jsonl", groups, step)
        if cfg.rollout.dynamic_filtering:
            groups = filter_groups(groups)
            metrics["rollout/kept_groups"] = len(groups)
        with timed(metrics, "perf/update_s"):
            if groups:  # dynamic filtering may leave nothing to learn from
                examples = to_examples(groups)
                if self.reward_model:
                    metrics |= add_reward_model_scores(examples, self.reward_model_scores(examples))
                if self.teacher:
                    set_per_token(examples, "teacher_logps", self.teacher.logps(examples))
                if self.ref:
                    set_per_token(examples, "ref_logps", self.ref.logps(examples))
                if self.critic:
                    set_per_token(examples, "values", self.critic.values(examples))
                if self.needs_old_logps():
                    set_per_token(examples, "old_logps", self.actor.logps(examples))
                metrics |= add_advantages(examples, cfg.adv, cfg.actor.kl, cfg.actor.teacher.coef)
                metrics |= self.actor.update(examples, len(groups))
                if self.critic:
                    metrics |= self.critic.update(examples, len(groups))
        with timed(metrics, "perf/sync_s"):
            self.rollout.sync_weights(self.actor.model, f"step{step}")
        return metrics

    def needs_old_logps(self) -> bool:
        """Old log-probs equal the current ones (detached) when one optimizer step covers the rollout."""
        actor = self.cfg.actor
        steps = actor.update_per_rollout * n_mini_batches(self.cfg.data.train.batch_size, actor.mini_batch_size)
        return steps > 1 or (actor.kl.coef > 0 and actor.kl.type == "reward") or self.teacher is not None

    @torch.no_grad()
    def reward_model_scores(self, examples: list[dict]) -> list[float]:
        """The reward model's score of every example: its scalar head at the last position, as it was trained."""
        per_token = per_token_pass(self.dims, examples, self.cfg.critic.max_length_per_device, self.device,
                                   lambda mb: forward_packed(self.reward_model.model, mb).values())
        return [values[-1] for values in per_token]

    def evaluate(self) -> dict[str, float]:
        if not self.test_data:
            return {}
        rollout = self.cfg.rollout
        groups = self.rollout.rollout(self.test_data, rollout.test_sampling_params, rollout.test_responses_per_prompt,
                                      rollout_seed(self.cfg.trainer.seed, 0, dist.get_rank()) + 1)
        metrics = rollout_metrics(groups, per_source=True)
        return {key.replace("rollout/", "test/", 1): value for key, value in metrics.items()}

    def load_trainer_state(self, state: dict) -> None:
        # The engines still hold the initial weights: give them the restored actor's.
        self.rollout.sync_weights(self.actor.model, f"step{state['step']}")


# ---- rows, examples and padded tensors ------------------------------------------------------------


def prompt_row_tokenizer(tokenizer) -> Callable:
    """split config -> (row -> {"prompt": text, "prompt_ids": ids, "extra_info": dict}) for `load_splits`."""

    def make(split_cfg):
        def tokenize_row(row: dict) -> dict:
            if split_cfg.apply_chat_template:
                messages = prompt_messages(row, split_cfg.prompt_key)
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            else:
                text = require_text(row, split_cfg.prompt_key)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) > split_cfg.max_length:
                raise BadRow(f"the prompt has {len(ids)} tokens, more than max_length={split_cfg.max_length}")
            return {"prompt": text, "prompt_ids": ids, "extra_info": dict(row.get("extra_info") or {})}

        return tokenize_row

    return make


def to_examples(groups: list[list[Trajectory]]) -> list[dict]:
    """Training examples of every trajectory, each tagged with the index of its prompt (`group`)."""
    return [example | {"group": g} for g, group in enumerate(groups) for t in group for example in t.to_examples()]


def set_per_token(examples: list[dict], key: str, values: list[list[float]]) -> None:
    for example, value in zip(examples, values):
        example[key] = value


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
    )


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
    return metrics


@contextmanager
def timed(metrics: dict, key: str):
    began = time.perf_counter()
    yield
    metrics[key] = time.perf_counter() - began


def main(argv: list[str] | None = None) -> None:
    launch(PPOTrainer, PPOConfig, "ppo", argv)


if __name__ == "__main__":
    main()
