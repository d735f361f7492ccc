"""Whether the rollout engine may sample: the one place that knows where its weights stand.

Three things decide it:
- the engine's memory: resident, or released to the trainer (colocated SGLang servers release their
  weights, KV cache and CUDA graphs while the trainer computes, and released weights lose their
  content: SGLang's memory saver keeps no copy);
- the version of its weights: which update of the policy they hold (`FSDPWorker.updates`, which every
  optimizer step and checkpoint load advances);
- the trainer's models: on the GPU, or moved to the CPU while a colocated engine samples.

`sampling()` is the only way to a rollout (training rollouts, evaluations, every dynamic-filtering
round, partial rollouts all go through it): it first brings the engine's weights to the policy's
current version, pushing them again when they were released or are stale, then moves the trainer's
models off the GPU and resumes the engine's cache; afterwards the engine releases its memory and the
trainer's models come back. A rollout on stale or released weights therefore cannot happen. With
`rollout.weight_sync=none` the engine keeps the weights it has (they are never released) and
policy updates do not reach it.

`synced(label)` is called after each update: it pushes at once when the engine's weights are resident
(embedded engine, external servers), else at the start of the next rollout, when the optimizer state
and the frozen models have left the GPU to make room for the servers' weights (see
`RL2.rollout.memory_plan` for the memory of each phase).
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

# SGLang's tags of the memory regions a colocated server releases.
WEIGHT_TAGS = ("weights",)
CACHE_TAGS = ("kv_cache", "cuda_graph")


class EngineState:
    """Args:
        engine: the rollout engine; with `releases_memory` it has `release_memory(tags)` and
            `resume_memory(tags)`.
        policy: the `FSDPWorker` whose weights the engine samples from; `policy.updates` is their version.
            None with `follows_policy=False`: the engine samples the weights it loaded.
        push: `push(label)` sends the policy's current weights to the engine (collective).
        colocated: the trainer's models that leave the GPU while the engine samples (empty: none do).
        releases_memory: the engine gives its GPU memory to the trainer between rollouts.
        follows_policy: the engine takes the policy's weights after updates (False for `weight_sync=none`).
    """

    def __init__(self, engine, policy, push: Callable[[str], None], colocated: Sequence = (),
                 releases_memory: bool = False, follows_policy: bool = True):
        self.engine, self.policy, self.push = engine, policy, push
        self.colocated, self.releases_memory, self.follows_policy = list(colocated), releases_memory, follows_policy
        self.weights_resident = self.cache_resident = True
        self.version: int | None = policy.updates if policy else None  # it starts from the policy's initial weights
        self.label = "step0"  # weight_version of the newest push

    @property
    def current(self) -> bool:
        """The engine's weights are resident and are the policy's (or stay the engine's own under `none`)."""
        return self.weights_resident and (not self.follows_policy or self.version == self.policy.updates)

    def synced(self, label: str) -> None:
        """The policy was updated (`label` names its weights): push now if the engine's weights are
        resident, else at the next rollout."""
        self.label = label
        if self.follows_policy and self.weights_resident and not self.current:
            self._push()

    @contextmanager
    def sampling(self) -> Iterator[None]:
        """The engine is ready to sample the policy's current weights inside; the trainer's afterwards."""
        self._make_current()
        for worker in self.colocated:
            worker.offload()
        if self.releases_memory and not self.cache_resident:
            self.engine.resume_memory(CACHE_TAGS)
            self.cache_resident = True
        try:
            yield
        except BaseException:
            self._onload_trainer()  # the run is failing: the trainer's state must still be reachable
            raise
        self.to_trainer()

    def to_trainer(self) -> None:
        """Give the GPU to the trainer: the engine releases its memory (its weights too, unless they are
        its own under `none`) and the trainer's models come back."""
        if self.releases_memory:
            tags = (WEIGHT_TAGS if self.follows_policy and self.weights_resident else ()) + (
                CACHE_TAGS if self.cache_resident else ())
            if tags:
                self.engine.release_memory(tags)
            if "weights" in tags:
                self.weights_resident, self.version = False, None
            self.cache_resident = False
        self._onload_trainer()

    def _make_current(self) -> None:
        if self.current:
            return
        # Room for the servers' weights next to the policy's parameters, which the push reads. A LoRA
        # policy's frozen base is read from the CPU instead, one tensor at a time (`full_tensors`).
        for worker in self.colocated:
            worker.offload(keep_params=worker is self.policy and getattr(worker, "lora", None) is None)
        if not self.weights_resident:
            self.engine.resume_memory(WEIGHT_TAGS)
            self.weights_resident = True
        if self.follows_policy:
            self._push()

    def _push(self) -> None:
        self.push(self.label)
        self.version = self.policy.updates

    def _onload_trainer(self) -> None:
        for worker in self.colocated:
            worker.onload()
