"""Each rank's share of a rollout: `prompts[rank::world_size]` rolled out, seeded, on its own engine through its
driver, then all-gathered, so that every rank holds the whole rollout in prompt order (the packing of the update
needs the global batch everywhere); and the weights pushed. Set up in `RL2.trainer.rollout_setup`; whether the
engine may sample: `EngineState`."""

import asyncio
import contextlib
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from RL2.engine.protocol import Engine, EngineError
from RL2.parallel import all_gather_objects
from RL2.rewards.judge import Judge, use_judge
from RL2.rollout.engine_state import EngineState
from RL2.rollout.event_loop import run_on_rank_loop
from RL2.rollout.trajectory import Trajectory, weight_version_number
from RL2.sandbox import run_sandbox, use_sandbox


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of one rank at one step: a resumed run samples what the uninterrupted one did."""
    return (seed * 1_000_003 + step) * 1_009 + rank


class RolloutWorker:
    """This rank's rollouts on `engine` through `driver` (an `EnvRollout`, or an agent script's `AgentRollout`, which
    has no partial rollout). `policy`: the trained `FSDPWorker` whose weights the engine samples, pushed in `dtype`
    (None: the engine keeps its own); `colocated`: the trainer's models on this GPU, which leave it while SGLang
    servers launched on it sample; `sandbox` and `judge`: the run's, for `code_reward` and `judge_reward`."""

    def __init__(self, engine: Engine, driver, device: torch.device, dtype: torch.dtype, policy=None,
                 colocated: Sequence = (), sandbox=None, judge: Judge | None = None):
        self.engine, self.driver, self.device, self.dtype, self.policy = engine, driver, device, dtype, policy
        self.sandbox = sandbox if sandbox is not None else run_sandbox()
        self.judge = judge
        self.push_seconds = 0.0  # spent pushing weights since `take_push_seconds` last read it
        # The trainer's models move off only for an engine that releases GPU memory (on CPU, offloading is
        # nothing and the embedded engine's pushes need not wait for it).
        shares_gpu = engine.releases_memory and device.type == "cuda"
        self.state = EngineState(engine, policy, self._push_weights, colocated if shares_gpu else [])
        self.state.to_trainer()  # launched GPU servers give their memory to the trainer until the first rollout

    def rollout(self, prompts: list[dict], sampling_params, responses_per_prompt: int,
                seed: int) -> list[list[Trajectory]]:
        """Roll out this rank's share of `prompts` (the whole batch, on every rank): every group, in prompt order."""
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = list(range(rank, len(prompts), world))
        groups = self._on_this_rank(seed, lambda: self.driver.batch(
            [prompts[i] for i in mine], responses_per_prompt, sampling_params) if mine else asyncio.sleep(0, []))
        self._fill_versions(groups)
        pairs = [pair for part in all_gather_objects(list(zip(mine, groups))) for pair in part]
        return [group for _, group in sorted(pairs, key=lambda p: p[0])]

    def partial_rollout(self, carried: list[list[Trajectory]], prompts: list[dict], sampling_params,
                        responses_per_prompt: int, seed: int, n_needed: int | None = None) -> tuple[list, list, list]:
        """`partial_rollout_batch` of this rank's share of the carried groups and of `prompts`, stopping once it has
        finished its share of `n_needed` groups (at least one; default: one per prompt; fewer than the groups
        started, `rollout.over_sampling`, cuts the slowest). Returns every rank's groups, the same on every rank."""
        rank, world = dist.get_rank(), dist.get_world_size()
        my_carried, my_prompts = carried[rank::world], prompts[rank::world]
        total = len(prompts) if n_needed is None else n_needed
        my_needed = max(len(range(rank, total, world)), 1) if my_carried or my_prompts else 0
        result = self._on_this_rank(seed, lambda: self.driver.partial_batch(
            my_carried, my_prompts, my_needed, responses_per_prompt, sampling_params) if my_needed
            else asyncio.sleep(0, ([], [], [])))
        self._fill_versions(result[0] + result[1])
        parts = all_gather_objects(result)
        return tuple([g for part in parts for g in part[i]] for i in range(3))

    def _fill_versions(self, groups: list[list[Trajectory]]) -> None:
        """Tokens sampled without the engine naming its weights (an older SGLang) get the version this rollout used."""
        version = weight_version_number(self.state.label) if self.state.follows_policy else 0
        if version is not None:
            for trajectory in (t for group in groups for t in group):
                trajectory.fill_versions(version)

    def _on_this_rank(self, seed: int, make_coroutine):
        """Run one rollout coroutine on this rank's engine, seeded. An error on any rank is raised on every rank (none
        left waiting in the gather) with every failing rank's message; an `EngineError` when only engines failed."""
        # Only a run with a judge puts one where judge_reward looks (without, judge_reward says none is set).
        judged = use_judge(self.judge) if self.judge is not None else contextlib.nullcontext()
        with self.state.sampling(), use_sandbox(self.sandbox), judged:
            # The engine samples with torch's global generator; fork it so the trainer's stream is untouched.
            devices = [self.device] if self.device.type == "cuda" else []
            result, error, failure = None, None, None
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                try:
                    result = run_on_rank_loop(make_coroutine())
                except Exception as e:
                    failure = e
                    error = (isinstance(e, EngineError), f"rank {dist.get_rank()}: {type(e).__name__}: {e}")
            errors = [e for e in all_gather_objects(error) if e]
            if errors:
                message = "\n".join(text for _, text in errors)
                if all(engine_failed for engine_failed, _ in errors):
                    raise EngineError("the rollout engine failed:\n" + message) from failure
                raise RuntimeError("the rollout failed:\n" + message) from failure
        return result

    def shutdown(self) -> None:
        """Stop the engine and the judge's (launched SGLang servers stop now, not when Python exits)."""
        self.engine.shutdown()
        if self.judge is not None:
            self.judge.close()

    def take_push_seconds(self) -> float:
        """Seconds spent pushing weights into the engine since the last call (at the sync, or for a colocated
        engine at the start of the next rollout: `EngineState.synced`)."""
        seconds, self.push_seconds = self.push_seconds, 0.0
        return seconds

    @torch.no_grad()
    def _push_weights(self, version: str) -> None:
        """Copy the policy's current weights into the engine, parameter by parameter (`FSDPWorker.full_tensors`);
        a LoRA policy's are merged on the way. Collective."""
        began = time.perf_counter()
        tensors = self.policy.full_tensors(self.dtype)
        self.engine.update_weights(self.policy.engine_weights(tensors), weight_version=version)
        self.push_seconds += time.perf_counter() - began
