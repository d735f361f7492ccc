"""Whether the rollout engine may sample, decided in one place from its memory (resident, or released to the
trainer), its weights' version (`FSDPWorker.updates`) and where the trainer's models are. `sampling()`, the only way
to a rollout, first brings the weights to the policy's current version: no rollout on stale or released weights.
The whole cycle and the memory of each phase: docs/gpus.md."""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

# SGLang's tags of the memory regions a colocated server releases.
WEIGHT_TAGS = ("weights",)
CACHE_TAGS = ("kv_cache", "cuda_graph")


class EngineState:
    """`policy` as `RolloutWorker` takes it (`policy.updates`: its weights' version); `push(label)` sends its weights
    to the engine (collective); `colocated`: the trainer's models that leave the GPU while the engine samples."""

    def __init__(self, engine, policy, push: Callable[[str], None], colocated: Sequence = ()):
        self.engine, self.policy, self.push, self.colocated = engine, policy, push, list(colocated)
        self.releases_memory = engine.releases_memory
        self.follows_policy = policy is not None and engine.follows_policy
        self.weights_resident = self.cache_resident = True
        self.version: int | None = policy.updates if policy else None  # it starts from the policy's initial weights
        self.label = "step0"  # weight_version of the newest push
        self.ready = False  # set up for sampling: weights current, the trainer's models off the GPU, cache resumed
        self.holds = 0  # open `holding()` scopes

    @property
    def current(self) -> bool:
        """The engine's weights are resident and are the policy's (or stay the engine's own under `none`)."""
        return self.weights_resident and (not self.follows_policy or self.version == self.policy.updates)

    def synced(self, label: str) -> None:
        """The policy was updated (`label` names its weights): push now, unless the push needs the GPU that
        the trainer's models hold (a colocated engine): then at the start of the next rollout."""
        self.label = label
        if self.follows_policy and not self.colocated:
            self._make_current()

    @contextmanager
    def sampling(self) -> Iterator[None]:
        """The engine is ready to sample the policy's current weights inside; the trainer's afterwards
        (inside `holding()`: at the end of that scope)."""
        if not (self.ready and self.current):
            self._make_current()
            for worker in self.colocated:
                worker.offload()
            if self.releases_memory and not self.cache_resident:
                self.engine.resume_memory(CACHE_TAGS)
                self.cache_resident = True
            self.ready = True
        try:
            yield
        except BaseException:
            self._onload_trainer()  # the run is failing: the trainer's state must still be reachable
            raise
        if not self.holds:
            self.to_trainer()

    @contextmanager
    def holding(self, give_back: bool = True) -> Iterator[None]:
        """Keep the engine ready across the rollouts inside (a step's dynamic-filtering rounds, which sample
        the same weights): the first `sampling()` sets it up, the trainer gets the GPU back at the end.
        `give_back=False` (an evaluation, whose weights the next rollout samples again) keeps it ready after the
        scope (`to_trainer_if_lent` gives it back). Nothing inside may update the policy or need the trainer's GPU."""
        self.holds += 1
        try:
            yield
        except BaseException:
            if self.holds == 1 and self.ready:
                self._onload_trainer()  # failing between rollouts: as `sampling` does
            raise
        finally:
            self.holds -= 1
        if not self.holds and self.ready and give_back:
            self.to_trainer()

    def to_trainer_if_lent(self) -> None:
        """The trainer needs its models outside a step (a checkpoint save): a colocated engine an evaluation left
        holding the GPU gives it back; one beside the trainer that releases memory (the embedded one) its cache."""
        if self.ready and self.colocated:
            self.to_trainer()
        elif self.releases_memory and self.cache_resident:
            self.engine.release_memory(CACHE_TAGS)
            self.ready = self.cache_resident = False

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
            self.push(self.label)
            self.version = self.policy.updates

    def _onload_trainer(self) -> None:
        self.ready = False
        for worker in self.colocated:
            worker.onload()
