"""The engine state machine end to end: PPO runs with the real embedded engine wrapped by a recording
test double (`tests/e2e/scripts/engine_call_order.py`) that, like a colocated SGLang server, loses its
weights' content when they are released and checks at every request that the weights it holds equal
the actor's current ones (the unit tests of `EngineState` are in tests/unit/test_engine_state.py); or,
with `--as-built`, records the calls of the embedded engine on CPU in the state the trainer built."""

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


# Rewards that differ within the groups of odd-numbered prompts only, so that dynamic filtering drops about
# half of each round's groups and every step has groups to learn from.
HALF_FILTERED_ENV = """import re


async def step(state, action, extra_info):
    odd = int(re.search(r"question (\\d+)", state).group(1)) % 2
    return {"next_state": state + action, "reward": float(len(action) % 2) if odd else 1.0, "done": True,
            "extra_info": extra_info}
"""


def half_filtered_env(tmp_path) -> str:
    env = tmp_path / "half_filtered.py"
    env.write_text(HALF_FILTERED_ENV)
    return str(env)


def pushed_versions(pushes: list[str]) -> list[str]:
    """The versions pushed ("step2" of "push step2@5"), checking that the actor's updates (after "@") grew
    at every push: each step trained."""
    updates = [int(push.split("@")[1]) for push in pushes]
    assert updates[0] == 0 and all(a < b for a, b in zip(updates, updates[1:])), pushes
    return [push.removeprefix("push ").split("@")[0] for push in pushes]


def test_ppo_never_samples_stale_or_released_weights(tiny_model_path, tmp_path):
    """Evaluations every step, dynamic filtering (up to 3 rounds) and partial rollouts, 3 steps, the engine
    colocated: the double found the engine's weights equal to the actor's current ones at every request;
    each version of the weights was pushed once, by the first rollout after its update (the evaluation),
    and the next step's rounds sampled it without a push or a move of the trainer's state."""
    result = engine_calls(tmp_path, tiny_model_path, f"rollout.env_path={half_filtered_env(tmp_path)}",
                          "rollout.dynamic_filtering=true", "rollout.max_sampling_rounds=3",
                          "rollout.partial_rollout=true", "actor.tis_coef=2", "trainer.test_freq=1")
    assert result["violations"] == []
    calls = result["calls"]
    assert calls[0] == RELEASE_ALL
    rollouts = blocks(calls)
    steps = [m for m in result["metrics"] if "perf/step_s" in m]
    assert sum(m.get("rollout/sampling_rounds", 1) for m in steps) > 3  # some step took more than one round
    # The evaluation at step k-1 and step k's rounds, for k = 1 to 3, then the last evaluation (the engine
    # gives the GPU back before the final export).
    assert len(rollouts) == 4
    for block in rollouts:
        # Weights back and pushed, then the cache; requests (partial rollouts may pause) only after that.
        assert block[:3] == ["resume weights", block[1], "resume kv_cache,cuda_graph"] and block[1].startswith("push")
        assert block[-1] == RELEASE_ALL
        assert all(c.startswith(("generate", "pause", "continue")) for c in block[3:-1]) and "generate" in block[3]
    assert all("rollout/carried_groups" in m for m in steps)  # every step went through partial_rollout (it
    # pauses only when more groups than needed are in flight, which depends on the samples)
    assert pushed_versions([block[1] for block in rollouts]) == [f"step{k}" for k in range(4)]
    # Each step's push, deferred to its evaluation, is timed with it.
    assert all(m["perf/weight_push_s"] > 0 and "perf/rollout_weight_push_s" not in m for m in steps)


def test_ppo_on_cpu_pushes_each_steps_weights_once_at_its_end(tiny_model_path, tmp_path):
    """The embedded engine on CPU as the trainer builds it, dynamic filtering (up to 3 rounds),
    evaluations before training and after steps 2 and 3, a checkpoint every step: the initial weights are
    pushed for the first evaluation, then each step's updated weights once, at the end of that step (after
    the release that gives the update its memory); no evaluation pushes or releases anything, and a
    checkpoint frees only the cache an evaluation left."""
    result = engine_calls(tmp_path, tiny_model_path, "--as-built", f"rollout.env_path={half_filtered_env(tmp_path)}",
                          "rollout.dynamic_filtering=true", "rollout.max_sampling_rounds=3", "trainer.test_freq=2",
                          "trainer.save_freq=1")
    assert result["violations"] == []
    calls = result["calls"]
    pushes = [call for call in calls if call.startswith("push")]
    assert pushed_versions(pushes) == [f"step{k}" for k in range(4)]
    def pushed_then_sampled(k):
        return ["resume weights", pushes[k], "resume kv_cache,cuda_graph", f"generate on step{k}"]

    # Step 2's and step 3's checkpoints follow an evaluation: each frees the cache that evaluation filled,
    # keeping the weights, which step 3's rollout samples without a push.
    assert calls == (pushed_then_sampled(0) + [RELEASE_ALL] + pushed_then_sampled(1) + [RELEASE_ALL]
                     + pushed_then_sampled(2) + [RELEASE_CACHE, "resume kv_cache,cuda_graph", "generate on step2",
                                                 RELEASE_ALL]
                     + pushed_then_sampled(3) + [RELEASE_CACHE])
    metrics = result["metrics"]
    assert [m["step"] for m in metrics if "test/response_length" in m] == [0, 2, 3]
    steps = [m for m in metrics if "perf/step_s" in m]
    assert len(steps) == 3 and all(m["rollout/sampling_rounds"] > 1 for m in steps)
    assert all(m["perf/weight_push_s"] > 0 and "perf/rollout_weight_push_s" not in m for m in steps)
    assert metrics[0]["step"] == 0 and metrics[0]["perf/weight_push_s"] > 0  # the initial weights' push


def test_ppo_with_weight_sync_none_samples_the_initial_weights(tiny_model_path, tmp_path):
    result = engine_calls(tmp_path, tiny_model_path, "rollout.weight_sync=none", "trainer.test_freq=1")
    assert result["violations"] == []
    assert not any(c.startswith(("push", "resume weights")) for c in result["calls"])
    assert result["calls"][0] == RELEASE_CACHE
    assert all(block == ["resume kv_cache,cuda_graph", "generate on initial", RELEASE_CACHE]
               for block in blocks(result["calls"]))
