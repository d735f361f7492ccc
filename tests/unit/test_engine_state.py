"""The engine state machine: no rollout samples released or stale weights, whatever the sequence of
rollouts, updates and evaluations.

Unit tests drive `EngineState` with recording test doubles of an engine (it records the order of the
calls it gets and, like a colocated SGLang server, loses its weights' content when they are released)
and of the trainer's models (they record moves on and off the GPU). The end-to-end tests run the PPO
trainer with the real embedded engine wrapped by such a recording double
(`tests/e2e/scripts/engine_call_order.py`), which checks at every request that the weights the engine
holds equal the actor's current ones.
"""

from contextlib import nullcontext

import pytest

from RL2.rollout.engine_state import EngineState

RELEASE_ALL = "release weights,kv_cache,cuda_graph"
RELEASE_CACHE = "release kv_cache,cuda_graph"


class RecordingEngine:
    """Records engine calls in order; released weights lose their content, as SGLang's memory saver's do."""

    def __init__(self, log: list[str], releases_memory: bool, follows_policy: bool):
        self.log, self.releases_memory, self.follows_policy = log, releases_memory, follows_policy
        self.resident = {"weights": True, "kv_cache": True, "cuda_graph": True}
        self.content = "initial"

    def release_memory(self, tags):
        self.log.append("release " + ",".join(tags))
        for tag in tags:
            assert self.resident[tag], f"{tag} released twice"
            self.resident[tag] = False
        if "weights" in tags:
            self.content = None

    def resume_memory(self, tags):
        self.log.append("resume " + ",".join(tags))
        for tag in tags:
            assert not self.resident[tag], f"{tag} resumed but not released (SGLang fails on it)"
            self.resident[tag] = True

    def push(self, content: str):
        assert self.resident["weights"], "weights pushed into released memory"
        self.log.append(f"push {content}")
        self.content = content

    def generate(self) -> str:
        assert all(self.resident.values()), f"sampling with released memory: {self.resident}"
        assert self.content is not None, "sampling released weights"
        self.log.append(f"generate on {self.content}")
        return self.content


class RecordingModel:
    """Stands in for an FSDPWorker: counts its updates, records where its state is."""

    def __init__(self, name: str, log: list[str]):
        self.name, self.log, self.updates = name, log, 0
        self.params_on_gpu = self.optimizer_on_gpu = True
        self.moves_off = 0  # times its state left the GPU

    def offload(self, keep_params: bool = False):
        self.moves_off += self.optimizer_on_gpu
        self.optimizer_on_gpu = False
        self.params_on_gpu = self.params_on_gpu and keep_params

    def onload(self):
        self.params_on_gpu = self.optimizer_on_gpu = True


def build(log, releases_memory=True, follows_policy=True, colocated=None):
    """`colocated` (default: `releases_memory`): the trainer's models share the engine's GPU, as with
    launched SGLang servers; an engine that releases memory without them is the embedded one on CPU."""
    colocated = releases_memory if colocated is None else colocated
    engine, policy, ref = RecordingEngine(log, releases_memory, follows_policy), RecordingModel("actor", log), (
        RecordingModel("ref", log))

    def push(label):
        # The push reads the policy's parameters while the rest of the trainer is off the GPU.
        assert policy.params_on_gpu and not (colocated and ref.optimizer_on_gpu)
        engine.push(f"{label}@{policy.updates}")

    state = EngineState(engine, policy, push, [policy, ref] if colocated else [])
    state.to_trainer()
    return state, engine, policy, ref


def rollout(state, engine, policy, ref) -> str:
    with state.sampling():
        if state.colocated:
            assert not policy.params_on_gpu and not ref.params_on_gpu, "the trainer stayed on the GPU"
        sampled = engine.generate()
    assert policy.params_on_gpu and ref.params_on_gpu
    return sampled


def update(state, policy, label):
    policy.updates += 1
    state.synced(label)


def test_colocated_engine_gets_the_current_weights_back_before_every_rollout():
    """Evaluation, train rollout, update, evaluation, train rollout: each rollout finds the weights
    released by the previous one and pushes the policy's current weights first."""
    log = []
    state, engine, policy, ref = build(log)
    assert rollout(state, engine, policy, ref) == "step0@0"  # evaluation before training
    assert rollout(state, engine, policy, ref) == "step0@0"  # step 1's rollout
    update(state, policy, "step1")  # weights released: the push waits for the next rollout
    assert rollout(state, engine, policy, ref) == "step1@1"  # evaluation after step 1
    assert rollout(state, engine, policy, ref) == "step1@1"  # step 2's rollout
    expected = [RELEASE_ALL]
    for content in ("step0@0", "step0@0", "step1@1", "step1@1"):
        expected += ["resume weights", f"push {content}", "resume kv_cache,cuda_graph", f"generate on {content}",
                     RELEASE_ALL]
    assert log == expected


def held_rounds(state, engine, policy, ref, rounds: int) -> list[str]:
    """One step's dynamic-filtering rounds inside `holding()`: the trainer stays off the GPU between them."""
    sampled = []
    with state.holding():
        for _ in range(rounds):
            with state.sampling():
                sampled.append(engine.generate())
            if state.colocated:
                assert not policy.params_on_gpu and not ref.params_on_gpu and not ref.optimizer_on_gpu
    assert policy.params_on_gpu and ref.params_on_gpu and ref.optimizer_on_gpu
    return sampled


def test_the_rounds_of_one_step_push_the_weights_once():
    """Three dynamic-filtering rounds in each of two steps: one push, one move of the trainer's state off
    the GPU and one release per step, not per round; the next step's rounds get the updated weights."""
    log = []
    state, engine, policy, ref = build(log)
    assert held_rounds(state, engine, policy, ref, 3) == ["step0@0"] * 3
    update(state, policy, "step1")
    assert held_rounds(state, engine, policy, ref, 3) == ["step1@1"] * 3
    expected = [RELEASE_ALL]
    for content in ("step0@0", "step1@1"):
        expected += ["resume weights", f"push {content}", "resume kv_cache,cuda_graph"] + [
            f"generate on {content}"] * 3 + [RELEASE_ALL]
    assert log == expected
    assert [entry for entry in log if entry.startswith("push")] == ["push step0@0", "push step1@1"]  # one a step


@pytest.mark.parametrize("where", ["in a round", "between rounds"])
def test_a_hold_that_fails_leaves_the_trainer_on_the_gpu(where):
    """A rollout that raises, or an error between two rounds (filtering the groups): the trainer's models
    come back; the next step finds the engine's memory as it was and releases it after sampling."""
    log = []
    state, engine, policy, ref = build(log)
    with pytest.raises(RuntimeError, match="failed"):
        with state.holding():
            with state.sampling():
                engine.generate()
            with state.sampling() if where == "in a round" else nullcontext():
                raise RuntimeError("failed")
    assert policy.params_on_gpu and ref.params_on_gpu and ref.optimizer_on_gpu
    assert held_rounds(state, engine, policy, ref, 2) == ["step0@0"] * 2
    assert log == [RELEASE_ALL, "resume weights", "push step0@0", "resume kv_cache,cuda_graph", "generate on step0@0",
                   "generate on step0@0", "generate on step0@0", RELEASE_ALL]


def evaluation(state, engine) -> str:
    """A test rollout, as PPO's evaluation runs it: the engine stays ready for the next step's rollout."""
    with state.holding(give_back=False):
        with state.sampling():
            return engine.generate()


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "beside_the_trainer"])
def test_evaluations_push_nothing_and_leave_the_trainer_in_place(colocated):
    """An evaluation before training, two steps of two rounds each followed by an evaluation, one step
    without: each version of the weights is pushed once, and a colocated trainer's state leaves the GPU
    once per step's rollout, not once more per evaluation (which samples what the next rollout samples)."""
    log = []
    state, engine, policy, ref = build(log, colocated=colocated)
    assert evaluation(state, engine) == "step0@0"
    for step in (1, 2):
        assert held_rounds(state, engine, policy, ref, 2) == [f"step{step - 1}@{step - 1}"] * 2
        update(state, policy, f"step{step}")
        assert evaluation(state, engine) == f"step{step}@{step}"
    assert held_rounds(state, engine, policy, ref, 2) == ["step2@2"] * 2
    update(state, policy, "step3")
    assert held_rounds(state, engine, policy, ref, 2) == ["step3@3"] * 2
    assert [entry for entry in log if entry.startswith("push")] == [f"push step{k}@{k}" for k in range(4)]
    # After the build's release, the weights go only at the end of each training rollout (four).
    assert log.count(RELEASE_ALL) == 1 + 4
    assert ref.moves_off == (4 if colocated else 0)


def test_an_engine_beside_the_trainer_is_pushed_at_the_sync():
    """The embedded engine on CPU releases its memory for the update, but the push needs no GPU of the
    trainer's: it comes back and takes the new weights at the sync, the step that trained them."""
    log = []
    state, engine, policy, ref = build(log, colocated=False)
    assert rollout(state, engine, policy, ref) == "step0@0"
    update(state, policy, "step1")
    assert log[-2:] == ["resume weights", "push step1@1"]
    assert rollout(state, engine, policy, ref) == "step1@1"
    assert log == [RELEASE_ALL, "resume weights", "push step0@0", "resume kv_cache,cuda_graph", "generate on step0@0",
                   RELEASE_ALL, "resume weights", "push step1@1", "resume kv_cache,cuda_graph", "generate on step1@1",
                   RELEASE_ALL]


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "beside_the_trainer"])
def test_a_checkpoint_after_an_evaluation_gets_the_trainers_models_back(colocated):
    """`to_trainer_if_lent` (before a checkpoint save): a colocated engine left ready by an evaluation
    gives the GPU back, and the next rollout pushes again; an engine beside the trainer frees its cache
    for the save and keeps its weights, which the next rollout samples without a push."""
    log = []
    state, engine, policy, ref = build(log, colocated=colocated)
    evaluation(state, engine)
    assert ref.optimizer_on_gpu == (not colocated)
    state.to_trainer_if_lent()
    assert policy.params_on_gpu and ref.params_on_gpu and ref.optimizer_on_gpu
    if not colocated:
        assert log[-1] == RELEASE_CACHE
    assert rollout(state, engine, policy, ref) == "step0@0"
    assert [entry for entry in log if entry.startswith("push")] == ["push step0@0"] * (2 if colocated else 1)
    if not colocated:
        assert log[-3:] == ["resume kv_cache,cuda_graph", "generate on step0@0", RELEASE_ALL]


def test_an_update_without_a_sync_is_pushed_at_the_next_rollout():
    """A stale engine (the policy moved and nobody synced) pushes before sampling, resident or not."""
    log = []
    state, engine, policy, ref = build(log, releases_memory=False)
    assert rollout(state, engine, policy, ref) == "initial"  # the engine starts from the policy's weights
    policy.updates += 1
    assert rollout(state, engine, policy, ref) == "step0@1"
    update(state, policy, "step2")  # resident weights: pushed at once
    assert log == ["generate on initial", "push step0@1", "generate on step0@1", "push step2@2"]
    assert rollout(state, engine, policy, ref) == "step2@2"


def test_weight_sync_none_keeps_the_engines_weights():
    """weight_sync=none: weights are never released nor replaced; the cache still goes back and forth."""
    log = []
    state, engine, policy, ref = build(log, follows_policy=False)
    for step in range(2):
        assert rollout(state, engine, policy, ref) == "initial"
        update(state, policy, f"step{step + 1}")
    assert log == [RELEASE_CACHE] + 2 * ["resume kv_cache,cuda_graph", "generate on initial", RELEASE_CACHE]


def test_a_failing_rollout_leaves_the_trainer_on_the_gpu():
    log = []
    state, engine, policy, ref = build(log)
    with pytest.raises(RuntimeError, match="engine died"):
        with state.sampling():
            raise RuntimeError("engine died")
    assert policy.params_on_gpu and ref.params_on_gpu and ref.optimizer_on_gpu
