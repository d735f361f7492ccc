"""The engine state machine end to end: PPO runs with the real embedded engine wrapped by a recording
test double (`tests/e2e/scripts/engine_call_order.py`) that, like a colocated SGLang server, loses its
weights' content when they are released and checks at every request that the weights it holds equal
the actor's current ones (the unit tests of `EngineState` are in tests/unit/test_engine_state.py)."""

import json

from tests.helpers.launch import run_ranks

RELEASE_ALL = "release weights,kv_cache,cuda_graph"
RELEASE_CACHE = "release kv_cache,cuda_graph"


def engine_calls(tmp_path, model: str, *overrides: str) -> dict:
    out = tmp_path / "calls.json"
    run_ranks(1, ["tests/e2e/scripts/engine_call_order.py", str(out), model, str(tmp_path), *overrides], timeout=600)
    return json.loads(out.read_text())


def blocks(calls: list[str]) -> list[list[str]]:
    """The calls split into rollouts: each ends with the release that gives the GPU back to the trainer."""
    result, current = [], []
    for call in calls[1:]:
        current.append(call)
        if call.startswith("release"):
            result.append(current)
            current = []
    assert not current
    return result


def test_ppo_never_samples_stale_or_released_weights(tiny_model_path, tmp_path):
    """Evaluations every step, dynamic filtering (up to 3 rounds) and partial rollouts, 3 steps: the
    double found the engine's weights equal to the actor's current ones at every request, and each step
    pushed them once for all its rounds."""
    result = engine_calls(tmp_path, tiny_model_path, "rollout.dynamic_filtering=true", "rollout.max_sampling_rounds=3",
                          "rollout.partial_rollout=true", "actor.tis_coef=2", "trainer.test_freq=1")
    assert result["violations"] == []
    calls = result["calls"]
    assert calls[0] == RELEASE_ALL
    rollouts = blocks(calls)
    assert sum(result["sampling_rounds"]) > 3  # some step took more than one round
    assert len(rollouts) == 3 + 4  # one per step, whatever its rounds, plus evaluations at steps 0 to 3
    for block in rollouts:
        # Weights back and pushed, then the cache; requests (partial rollouts may pause) only after that.
        assert block[:3] == ["resume weights", block[1], "resume kv_cache,cuda_graph"] and block[1].startswith("push")
        assert block[-1] == RELEASE_ALL
        assert all(c.startswith(("generate", "pause", "continue")) for c in block[3:-1]) and "generate" in block[3]
    assert result["partial_rollouts"] == 3  # every step went through partial_rollout (it pauses only when
    # more groups than needed are in flight, which depends on the samples)
    pushed = [block[1] for block in rollouts]
    assert pushed[0] == "push step0@0" and pushed[-1].startswith("push step3@")  # labelled by the last sync


def test_ppo_with_weight_sync_none_samples_the_initial_weights(tiny_model_path, tmp_path):
    result = engine_calls(tmp_path, tiny_model_path, "rollout.weight_sync=none", "trainer.test_freq=1")
    assert result["violations"] == []
    assert not any(c.startswith(("push", "resume weights")) for c in result["calls"])
    assert result["calls"][0] == RELEASE_CACHE
    assert all(block == ["resume kv_cache,cuda_graph", "generate on initial", RELEASE_CACHE]
               for block in blocks(result["calls"]))
