"""The PPO trainer on one CPU rank with a recording test double around its real embedded engine.

    python tests/e2e/scripts/engine_call_order.py OUT.json MODEL WORKDIR [--as-built] [key=value ...]

The double (`RecordingEngine`) forwards generation and weight updates to the real `EmbeddedEngine`
and behaves, for memory, like a colocated SGLang server: it has weights, KV cache and CUDA graph
regions that can be released and resumed, and releasing the weights destroys them (it writes NaN
into the engine through its own `update_weights`). It records the order of the calls it gets, and at
the first request after any change it checks, independently of RL2's bookkeeping, that every region
is resident, that the engine's weights equal the actor's current full weights (or, with
`rollout.weight_sync=none`, the initial ones) and that the trainer's models are off the "GPU". The
trainer's models record their moves. OUT.json gets the calls, the violations found and the metrics
of every step.

With `--as-built` the double passes the memory calls on to the real engine (which on CPU frees its
weights and cache) and stands in the trainer's own `EngineState`, as the trainer built it: it records
the calls of the embedded engine on CPU and checks the weights at every request as above.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

from RL2.config import parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.rollout.engine_state import EngineState
from RL2.trainer.ppo import PPOTrainer
from RL2.workers.fsdp import full_tensors
from tests.helpers import ENVS

ENV = ENVS / "emit_token.py"


class RecordingEngine:
    """A recording test double around the real embedded engine (see the module docstring)."""

    def __init__(self, inner, engine_runner, expected_weights, policy, colocated, follows_policy: bool,
                 as_built: bool = False):
        self.inner, self.engine_runner, self.follows_policy = inner, engine_runner, follows_policy
        self.expected_weights, self.policy, self.colocated, self.as_built = (
            expected_weights, policy, colocated, as_built)
        self.releases_memory = inner.releases_memory if as_built else True  # as colocated SGLang servers do
        self.resident = {"weights": True, "kv_cache": True, "cuda_graph": True}
        self.content = "initial"
        self.calls: list[str] = []
        self.violations: list[str] = []
        self._checked = False

    def _record(self, call: str) -> None:
        if not (call.startswith("generate") and self.calls and self.calls[-1] == call):
            self.calls.append(call)

    def release_memory(self, tags):
        self._record("release " + ",".join(tags))
        for tag in tags:
            self.resident[tag] = False
        if self.as_built:
            self.inner.release_memory(tags)
        elif "weights" in tags:  # SGLang's memory saver keeps no copy of released weights
            self.inner.update_weights((name, torch.full_like(p, float("nan")))
                                      for name, p in self.engine_runner.state_dict().items())
        if "weights" in tags:
            self.content = None
        self._checked = False

    def resume_memory(self, tags):
        self._record("resume " + ",".join(tags))
        for tag in tags:
            if self.resident[tag]:
                self.violations.append(f"resume of {tag}, which was not released")
            self.resident[tag] = True
        if self.as_built:
            self.inner.resume_memory(tags)
        self._checked = False

    def update_weights(self, named_tensors, weight_version):
        if not self.resident["weights"]:
            self.violations.append("weights pushed into released memory")
        if not all(w.params_on_gpu for w in self.colocated[:1]):
            self.violations.append("the push found the policy's parameters off the GPU")
        self.inner.update_weights(named_tensors, weight_version)
        self.content = weight_version
        self._record(f"push {weight_version}@{self.policy.updates}")
        self._checked = False

    async def generate(self, payload):
        if not self._checked:
            self._check()
            self._checked = True
        self._record(f"generate on {self.content}")
        return await self.inner.generate(payload)

    async def pause_generation(self, mode="abort"):
        self._record(f"pause {mode}")
        await self.inner.pause_generation(mode)

    async def continue_generation(self):
        self._record("continue")
        await self.inner.continue_generation()

    def _check(self) -> None:
        released = [tag for tag, resident in self.resident.items() if not resident]
        if released:
            self.violations.append(f"request while {released} released")
        if any(w.params_on_gpu for w in self.colocated):
            self.violations.append("request while the trainer's models are on the GPU")
        engine_weights = self.engine_runner.state_dict()
        for name, expected in self.expected_weights():
            if not torch.equal(engine_weights[name], expected):
                self.violations.append(f"request on weights other than the expected ones ({name}, {self.content})")
                return


class RecordingModel:
    """Wraps an FSDPWorker's offload/onload (no-ops on CPU) to record where its state would be."""

    def __init__(self, worker):
        self.worker, self.params_on_gpu = worker, True
        offload, onload = worker.offload, worker.onload

        def recorded_offload(keep_params=False):
            offload(keep_params=keep_params)
            self.params_on_gpu = self.params_on_gpu and keep_params

        def recorded_onload():
            onload()
            self.params_on_gpu = True

        worker.offload, worker.onload = recorded_offload, recorded_onload


def main(out: str, model: str, workdir: str, *overrides: str) -> None:
    as_built = "--as-built" in overrides
    overrides = tuple(o for o in overrides if o != "--as-built")
    work = Path(workdir)
    for split, n in (("train", 16), ("test", 4)):
        rows = [{"prompt": f"{split} question {k}", "extra_info": {}} for k in range(n)]
        (work / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(PPOConfig, "ppo", [
        f"data.train.path={work / 'train.jsonl'}", f"data.test.path={work / 'test.jsonl'}", "data.train.batch_size=4",
        f"rollout.env_path={ENV}", "rollout.responses_per_prompt=4", "rollout.train_sampling_params.max_new_tokens=4",
        "rollout.test_sampling_params.max_new_tokens=4", f"actor.model_name={model}", "actor.dtype=float32",
        "actor.optimizer.lr=1e-2", "actor.max_length_per_device=512", f"trainer.save_dir={work / 'run'}",
        "trainer.total_steps=3", *overrides])
    trainer = PPOTrainer(cfg)
    rollout = trainer.rollout
    follows = cfg.rollout.weight_sync != "none"
    initial = {name: t.clone() for name, t in full_tensors(trainer.actor.model, rollout.dtype)}

    def expected_weights():
        return full_tensors(trainer.actor.model, rollout.dtype) if follows else initial.items()

    if as_built:  # the trainer's state, which released the engine's weights and cache when it was built
        double = RecordingEngine(rollout.engine, rollout.engine.runner, expected_weights, trainer.actor.worker, [],
                                 follows, as_built=True)
        double.resident = {"weights": False, "kv_cache": False, "cuda_graph": False}
        rollout.engine = rollout.state.engine = double
        rollout.driver = dataclasses.replace(rollout.driver, engine=double)
    else:
        # The double replaces the trainer's engine bookkeeping: the engine starts from the initial weights
        # (the real embedded engine released its own when the trainer was built).
        rollout.engine.update_weights(initial.items(), "initial")
        colocated = [RecordingModel(trainer.actor.worker)]
        double = RecordingEngine(rollout.engine, rollout.engine.runner, expected_weights, trainer.actor.worker,
                                 colocated, follows)
        rollout.engine = double
        rollout.driver = dataclasses.replace(rollout.driver, engine=double)
        rollout.state = EngineState(double, trainer.actor.worker, rollout._push_weights, [trainer.actor.worker])
        rollout.state.to_trainer()
    trainer.train()
    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    Path(out).write_text(json.dumps({"calls": double.calls, "violations": double.violations, "metrics": metrics}))


if __name__ == "__main__":
    main(*sys.argv[1:])
