"""RL with verifiable rewards: `torchrun -m RL2.trainer.ppo data.train.path=rl.jsonl rollout.env_path=envs/x.py`.

One step: roll out, score, compute what the estimator of `adv.estimator` needs, update the actor (and critic),
push the new weights into the engines (docs/rl.md, docs/async.md). The default recipe, `adv.estimator=grpo`:
a response's advantage is its score minus its prompt group's mean, not divided by the std (Dr. GRPO), in PPO's
clipped surrogate averaged over every trained token of the batch (`actor.avg_level=token`); no KL, no reference."""

import functools

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from RL2.batch import RolloutBatch
from RL2.config.errors import ConfigError
from RL2.config.ppo_schema import PPOConfig, resets_reference
from RL2.datasets.splits import EpochSampler
from RL2.models.lora import merge_into_base
from RL2.parallel import shard_of
from RL2.rollout.loop import drop_stale_groups, filter_groups
from RL2.rollout.metrics import (
    COUNTS,
    evaluation_metrics,
    fault_summary,
    rollout_metrics,
    save_samples,
    split_summary,
    staleness_metrics,
)
from RL2.rollout.sample_tokens import sample_tokens
from RL2.rollout.trajectory import Trajectory, training_batch
from RL2.rollout.worker import rollout_seed
from RL2.trainer.base import Trainer, launch
from RL2.trainer.ppo_advantages import add_advantages, add_reward_model_scores, shape_rewards
from RL2.trainer.rollout_setup import (
    RolloutScript,
    calls_tools,
    close_script,
    load_rollout_script,
    makes_prompts,
    prompt_row_maker,
    rollout_worker,
    tools_of,
)
from RL2.utils.logging import is_rank0, log_rank0, truncate_jsonl_after
from RL2.utils.memory import max_over_ranks, measured
from RL2.utils.plot import CurvePanel
from RL2.workers.actor import Actor, BaseModelReference, n_mini_batches
from RL2.workers.critic import Critic, RewardModel
from RL2.workers.fsdp import load_tokenizer


class PPOTrainer(Trainer):
    """`env`: what is rolled out; default: `load_rollout_script(cfg.rollout)` (`RL2.train` passes a Python reward)."""

    learning_curve = (
        CurvePanel("reward and score", ("rollout/reward", "rollout/score", "test/*/score")),
        CurvePanel("response length", ("rollout/response_length", "test/response_length"), ylabel="tokens"),
        # Where the policy calls tools (an environment's TOOLS, an agent); left out of other runs' curves.
        CurvePanel("tool use", ("rollout/tool_calls", "test/tool_calls", "rollout/tool_parse_errors",
                                "rollout/tool_errors"), ylabel="per trajectory"),
    )
    # With a partial rollout, how old the trained tokens are and how far the engine's log-probabilities
    # are from the trainer's, of the current weights' tokens and of older ones.
    partial_rollout_curve = (
        CurvePanel("staleness", ("staleness/lag_*",), ylabel="share of trained tokens", ylim=(0.0, 1.0)),
        CurvePanel("engine vs trainer KL", ("actor/engine_kl_lag0", "actor/engine_kl_lagged"), ylabel="KL"),
    )

    def __init__(self, cfg, env: RolloutScript | None = None):
        super().__init__(cfg, cfg.actor)
        self.tokenizer = load_tokenizer(cfg.actor, "actor")
        self.env = env if env is not None else load_rollout_script(cfg.rollout)
        self.calls_tools = calls_tools(self.env)  # the rollout's tool metrics mean something
        self.tool_use = tools_of(self.env, cfg.rollout, self.tokenizer)  # the prompts show them, the rollout runs them
        make_row = prompt_row_maker(self.env, self.tool_use, self.tokenizer)
        # An environment that makes every prompt may run with no data: a split of rows with no prompt.
        blank = {"train": ("data.train.batch_size", cfg.data.train.batch_size),
                 "test": ("rollout.test_prompts_per_rollout", cfg.rollout.test_prompts_per_rollout)}
        self.load_data(make_row, blank if makes_prompts(self.env) else None, keep_row=True)  # samples.jsonl names rows
        if cfg.actor.freeze_steps >= self.n_steps:
            raise ConfigError(f"actor.freeze_steps={cfg.actor.freeze_steps} holds the actor for the whole run of "
                              f"{self.n_steps} steps; lower it or raise trainer.total_steps")
        # Which test prompts evaluation k takes (`EpochSampler.batch(k)`), in an order of its own seed; None: all.
        per_test, n_test = cfg.rollout.test_prompts_per_rollout, len(self.test_data)
        self.test_sampler = None if per_test is None or per_test >= n_test else EpochSampler(
            n_test, per_test, shuffle=True, seed=cfg.trainer.seed + 1)
        if cfg.rollout.partial_rollout:
            self.learning_curve = self.learning_curve + self.partial_rollout_curve
        # Rollout state that a resume restores: rollouts so far (dynamic filtering may draw several per step),
        # prompts drawn (over-sampling draws more than a batch), unfinished groups and evaluations done.
        self.cursor = self.drawn = self.test_cursor = 0
        self.carried: list[list[Trajectory]] = []
        self._build_workers()

    def run(self, n_steps: int) -> None:
        try:
            super().run(n_steps)
        finally:
            close_script(self.env)

    def _build_workers(self) -> None:
        cfg, args = self.cfg, (self.dims, self.device)
        budget = cfg.rollout.train_sampling_params.max_new_tokens  # the normaliser of avg_level=constant
        # The policy, its reference and the teacher are all the distributions at the sampling temperature.
        temperature = cfg.rollout.train_sampling_params.temperature
        lora = cfg.actor.lora.rank > 0
        resets_merge = lora and cfg.actor.kl.coef > 0 and resets_reference(cfg.actor.kl)  # into the actor's base
        # Each model's optimizer steps over the run (its learning-rate schedule's length).
        actor_steps = (self.n_steps - cfg.actor.freeze_steps) * self.steps_per_rollout(cfg.actor)
        self.actor = Actor(cfg.actor, *args, actor_steps, response_budget=budget,
                           base_changes=resets_merge, temperature=temperature)
        self.ref = None
        if cfg.actor.kl.coef > 0:  # under LoRA, the actor's own base with the adapters off: no second copy
            self.ref = BaseModelReference(self.actor) if lora else Actor(cfg.actor, *args, train=False,
                                                                         temperature=temperature)
        teacher = cfg.actor.teacher.model_name
        self.teacher = Actor(cfg.actor, *args, train=False, model_name=teacher, temperature=temperature) if (
            teacher) else None
        reward_model = cfg.rollout.reward_model
        self.reward_model = RewardModel(cfg.critic, *args, reward_model) if reward_model else None
        critic_steps = self.n_steps * self.steps_per_rollout(cfg.critic)
        self.critic = Critic(cfg.critic, *args, critic_steps, response_budget=budget) if (
            cfg.adv.estimator == "gae") else None
        on_gpu = [m.worker for m in (self.actor, self.ref, self.teacher, self.critic, self.reward_model) if m]
        on_gpu = list(dict.fromkeys(on_gpu))  # a LoRA policy's reference is its own worker
        self.rollout = rollout_worker(cfg.rollout, cfg.actor, self.tokenizer, self.device, self.env, self.tool_use,
                                      policy=self.actor.worker, colocated=on_gpu, seed=cfg.trainer.seed)

    def steps_per_rollout(self, model_cfg) -> int:
        """A model's optimizer steps per rollout: `update_per_rollout` passes, a step per mini-batch."""
        return model_cfg.update_per_rollout * n_mini_batches(self.cfg.data.train.batch_size, model_cfg.mini_batch_size)

    def workers(self) -> dict:
        workers = {"actor": self.actor.worker} | ({"critic": self.critic.worker} if self.critic else {})
        if self.ref and resets_reference(self.cfg.actor.kl) and self.ref.worker is not self.actor.worker:
            workers["ref"] = self.ref.worker  # no longer the initial weights: checkpoint it
        return workers

    def reclaim_devices(self) -> None:
        self.rollout.state.to_trainer_if_lent()

    def save_final(self) -> None:
        super().save_final()
        if self.cfg.rollout.save_samples:
            log_rank0(f"view the trajectories: python -m RL2.viewer {self.cfg.trainer.save_dir}")

    def trainer_state(self) -> dict:
        return {"cursor": self.cursor, "drawn": self.drawn,
                "carried": [[t.to_dict() for t in group] for group in self.carried], "test_cursor": self.test_cursor}

    def train_step(self, step: int) -> dict[str, float]:
        cfg, metrics = self.cfg, {}
        with measured(metrics, "rollout"), self.rollout.state.holding():  # one push for all of the step's rounds
            groups, rolled_out = self.collect_groups(step, metrics)
        if pushed := self.rollout.take_push_seconds():  # weights that no step's end pushed (see the sync below)
            metrics["perf/rollout_weight_push_s"] = pushed
        metrics |= rollout_metrics(rolled_out, tools=self.calls_tools)
        outcome = "trained as reward 0" if cfg.rollout.train_on_faults else "left out of the loss"
        if faults := fault_summary(rolled_out, outcome):
            log_rank0(f"step {step}: {faults} ({self.env.path})")
        if splits := split_summary(rolled_out, self.tokenizer.name_or_path):
            log_rank0(f"step {step}: {splits}")
        sampled = sum(t.response_length for group in rolled_out for t in group)
        metrics["perf/rollout_tokens_per_s"] = sampled / metrics["perf/rollout_s"]
        # The weights trained (and sampled with) at this step are those of step - 1's update.
        metrics |= staleness_metrics(groups, step - 1, cfg.rollout.max_staleness or 0)
        batch = None
        if groups:  # dynamic filtering may leave nothing to learn from
            # PPO's critic warm-up: for the first actor.freeze_steps steps only the critic learns.
            batch = training_batch(groups, version=step - 1, train_on_faults=cfg.rollout.train_on_faults)
            metrics["actor/faulted_excluded"] = float(batch.n_samples - batch.n_trained)
            if batch.input_ids:  # not when every trajectory faulted
                metrics |= self.learn(batch, update_actor=step > cfg.actor.freeze_steps)
        if cfg.rollout.save_samples and is_rank0():  # after the update: with its advantages and log-probs
            limit = cfg.rollout.save_sample_tokens
            tokens = sample_tokens(rolled_out, self.tokenizer, limit, groups, batch) if limit else None
            save_samples(f"{cfg.trainer.save_dir}/samples.jsonl", rolled_out, step, tokens,
                         {"data": cfg.data.train.path or None, "script": str(self.env.path)})
        # Timed as `perf/weight_push_s`; colocated SGLang servers defer the push until the trainer's state leaves
        # the GPU (docs/rl.md, "Checkpoints and metrics").
        with measured(metrics, "sync"):
            self.rollout.state.synced(f"step{step}")
        metrics["perf/weight_push_s"] = self.rollout.take_push_seconds()
        if self.ref and resets_reference(cfg.actor.kl):
            metrics["actor/ref_reset"] = float(self.maybe_reset_reference(step, metrics.get("actor/ref_kl"),
                                                                          metrics.get("actor/entropy")))
        max_over_ranks(metrics, self.device)
        return metrics

    def learn(self, batch: RolloutBatch, update_actor: bool = True) -> dict[str, float]:
        """Everything between the rollout and the weight sync (the actor's update only with `update_actor`)."""
        cfg, metrics = self.cfg, {}
        metrics |= shape_rewards(batch, cfg.rollout)
        if self.reward_model:
            with measured(metrics, "reward_model"):
                metrics |= add_reward_model_scores(batch, self.reward_model.scores(batch))
        # (timed as, per-token result, the pass when one is needed)
        for name, token, compute in (("teacher", "teacher_logps", self.teacher and self.teacher.logps),
                                     ("ref", "ref_logps", self.ref and self.ref.logps),
                                     ("values", "values", self.critic and self.critic.values),
                                     ("old_logps", "old_logps", self.needs_old_logps() and self.actor.logps)):
            if compute:
                with measured(metrics, name):
                    batch.tokens[token] = compute(batch)
        metrics |= add_advantages(batch, cfg.adv, cfg.actor.kl, cfg.actor.teacher.coef)
        if update_actor:
            with measured(metrics, "actor_update"):
                metrics |= self.actor.update(batch)
            n_tokens = sum(len(ids) for ids in batch.input_ids) * cfg.actor.update_per_rollout  # over every pass
            metrics["perf/actor_update_tokens_per_s"] = n_tokens / metrics["perf/actor_update_s"]
        metrics["actor/frozen"] = float(not update_actor)
        if self.critic:
            with measured(metrics, "critic_update"):
                metrics |= self.critic.update(batch)
        return metrics

    def collect_groups(self, step: int, metrics: dict) -> tuple[list[list[Trajectory]], list[list[Trajectory]]]:
        """The step's training groups, and every group rolled out for it (for metrics and samples), under the
        rollout controls of docs/rl.md: dynamic filtering (DAPO), partial rollout, over-sampling, staleness."""
        rollout, batch_size = self.cfg.rollout, self.cfg.data.train.batch_size
        if rollout.max_staleness is not None:  # before they are resumed: they could only get older
            self.carried, metrics["staleness/dropped_groups"] = drop_stale_groups(self.carried, step - 1,
                                                                                  rollout.max_staleness)
        kept, rolled_out, rounds = [], [], 0
        while len(kept) < batch_size and rounds < (rollout.max_sampling_rounds if rollout.dynamic_filtering else 1):
            prompts = self.draw_prompts(batch_size + max(0, rollout.over_sampling - len(self.carried)))
            seed = rollout_seed(self.cfg.trainer.seed, self.cursor + 1, dist.get_rank())
            self.cursor += 1
            rounds += 1
            params, n = rollout.train_sampling_params, rollout.responses_per_prompt
            if rollout.partial_rollout:
                groups, self.carried, new = self.rollout.partial_rollout(self.carried, prompts, params, n, seed,
                                                                         n_needed=batch_size)
            else:
                groups = new = self.rollout.rollout(prompts, params, n, seed)
            rolled_out += new  # a group finished beyond an earlier batch was reported then
            kept += filter_groups(groups, rollout.train_on_faults) if rollout.dynamic_filtering else groups
        if rollout.partial_rollout:  # finished beyond the batch: keep them for the next step
            self.carried = kept[batch_size:] + self.carried
            metrics["rollout/carried_groups"] = len(self.carried)
        if rollout.dynamic_filtering:
            metrics |= {"rollout/kept_groups": min(len(kept), batch_size), "rollout/sampling_rounds": rounds}
        return kept[:batch_size], rolled_out

    def draw_prompts(self, n: int) -> list[dict]:
        """The next `n` prompts of the training order (the sampler's batches one after another): a step's
        batch, or with `rollout.over_sampling` more, the rest of a batch waiting for the next draw."""
        batch = functools.cache(self.sampler.batch)  # each batch the prompts span, shuffled once
        size, first = self.sampler.batch_size, self.drawn
        self.drawn += n
        return [self.train_data[batch(p // size)[p % size]] for p in range(first, first + n)]

    @torch.no_grad()
    def maybe_reset_reference(self, step: int, ref_kl: float | None, entropy: float | None = None) -> bool:
        """ProRL's reference reset (arXiv 2505.24864; docs/rl.md, docs/lora.md), when due: reference = alpha * actor
        + (1 - alpha) * reference. Both are sharded alike, so each rank mixes its own shards."""
        kl = self.cfg.actor.kl
        due = (kl.reset_every and step % kl.reset_every == 0) or (
            kl.reset_target is not None and ref_kl is not None and ref_kl > kl.reset_target) or (
            kl.reset_entropy_floor is not None and entropy is not None and entropy < kl.reset_entropy_floor)
        if not due:
            return False
        for module in [*self.ref.model.modules(), *self.actor.model.modules()]:
            # After a forward FSDP may keep a module's gathered copies registered (the root's, always); writes to
            # those would be lost at the next reshard, while the shards are what every later forward gathers.
            if isinstance(module, FSDPModule):
                module.reshard()
        if self.ref.model is self.actor.model:  # LoRA: the reference is the actor's base
            merge_into_base(self.actor.model, kl.reset_alpha)
        else:
            for ref_param, actor_param in zip(self.ref.model.parameters(), self.actor.model.parameters()):
                local = shard_of(ref_param)
                local.lerp_(shard_of(actor_param).to(local.dtype), kl.reset_alpha)
        log_rank0(f"step {step}: reference reset (alpha={kl.reset_alpha}, KL to it was {ref_kl}, entropy {entropy})")
        return True

    def needs_old_logps(self) -> bool:
        """Old log-probs equal the current ones (detached) when one optimizer step covers the rollout."""
        actor = self.cfg.actor
        return (self.steps_per_rollout(actor) > 1 or (actor.kl.coef > 0 and actor.kl.type == "reward")
                or self.teacher is not None or self.cfg.rollout.save_sample_tokens > 0)  # the latter saves them

    def evaluate(self) -> dict[str, float]:
        if not self.test_data:
            return {}
        rollout, prompts = self.cfg.rollout, self.test_data
        if self.test_sampler is not None:  # rollout.test_prompts_per_rollout: the next batch of a shuffled order
            self.test_cursor += 1
            prompts = [self.test_data[i] for i in self.test_sampler.batch(self.test_cursor - 1)]
        # The engine keeps the weights for the next step's rollout, which samples them again.
        with self.rollout.state.holding(give_back=False):
            groups = self.rollout.rollout(prompts, rollout.test_sampling_params,
                                          rollout.test_responses_per_prompt,
                                          rollout_seed(self.cfg.trainer.seed, 0, dist.get_rank()) + 1)
        metrics = {key.replace("rollout/", "test/", 1): value
                   for key, value in rollout_metrics(groups, tools=self.calls_tools).items()}
        if pushed := self.rollout.take_push_seconds():  # the push a colocated engine deferred from the step
            metrics["perf/weight_push_s"] = pushed
        if faults := fault_summary(groups):
            log_rank0(f"test rollout: {faults} ({self.env.path})")
        sources = [str(group[0].extra_info.get("data_source", "default")) for group in groups]
        by_source = evaluation_metrics(groups, sources, [rollout.test_responses_per_prompt], threshold=1.0)["by_source"]
        return metrics | {f"test/{source}/{name}": value for source, source_metrics in by_source.items()
                          for name, value in source_metrics.items() if name not in COUNTS}

    def truncate_outputs_after(self, step: int) -> None:
        super().truncate_outputs_after(step)
        if is_rank0():
            truncate_jsonl_after(f"{self.cfg.trainer.save_dir}/samples.jsonl", step)

    def load_trainer_state(self, state: dict) -> None:
        self.cursor = state.get("cursor", state["step"])
        # Before rollout.over_sampling, each rollout drew one batch.
        self.drawn = state.get("drawn", self.cursor * self.sampler.batch_size)
        # Tokens carried by a checkpoint from before weight versions were kept: taken to be of the last weights.
        self.carried = [[Trajectory.from_dict(t, version=state["step"] - 1) for t in group]
                        for group in state.get("carried", [])]
        self.test_cursor = state.get("test_cursor", 0)
        # The engines still hold the initial weights: give them the restored actor's.
        self.rollout.state.synced(f"step{state['step']}")
        self.rollout.take_push_seconds()  # that push is of no step's weights


def main(argv: list[str] | None = None) -> None:
    launch(PPOTrainer, PPOConfig, "ppo", argv)


if __name__ == "__main__":
    main()
