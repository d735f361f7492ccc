"""The environment scripts in envs/ on hand-written actions (and GEM on the tiny engine)."""

import asyncio
import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from RL2.rollout.env import load_env
from RL2.rollout.loop import EnvRollout, run_trajectory
from RL2.rollout.trajectory import Trajectory
from tests.helpers import REPO

ENVS = REPO / "envs"  # the environments RL2 ships


def step(name: str, action: str, extra_info: dict, state: str = "Q: ") -> dict:
    env = load_env(ENVS / f"{name}.py")
    result = asyncio.run(env.step(state, action, extra_info))
    return {"reward": result.reward, "score": result.score, "done": result.done, "next_state": result.next_state}


@pytest.mark.parametrize(
    "action, reward",
    [
        ("so <answer>3 * 5 + 7</answer>", 1.0),
        ("<answer>(7 - 5) * 3</answer> <answer>7 + 5 * 3</answer>", 1.0),  # the last answer counts
        ("<answer>(3 + 5) * 7</answer>", 0.0),  # 56, not 22
        ("<answer>3 * 5 + 7 + 7</answer>", 0.0),  # 7 used twice
        ("<answer>7 * 3 + 1</answer>", 0.0),  # 1 is not given, 5 unused
        ("<answer>3 ** 5 + 7</answer>", 0.0),
        ("<answer>__import__('os').system('true')</answer>", 0.0),
        ("<answer>3 / (5 - 5) + 7</answer>", 0.0),
        ("<answer>3 * 5 + </answer>", 0.0),
        ("<answer>3 * 5 + '7'</answer>", 0.0),  # a string: a wrong answer, not a fault of the env
        ("3 * 5 + 7", 0.0),
    ],
)
def test_countdown(action, reward):
    result = step("countdown", action, {"numbers": [3, 5, 7], "target": 22})
    assert (result["reward"], result["score"], result["done"]) == (reward, reward, True)


def test_countdown_never_evaluates_model_text(tmp_path):
    marker = tmp_path / "pwned"
    action = f"<answer>__import__('pathlib').Path({str(marker)!r}).touch()</answer>"
    assert step("countdown", action, {"numbers": [1], "target": 1})["reward"] == 0.0
    assert not marker.exists()


@pytest.mark.parametrize(
    "action, reward, score",
    [
        ("12 + 30 = 42 <answer>42</answer>", 1.0, 1.0),
        ("<answer> 42.0 </answer>", 1.0, 1.0),
        ("<answer>41</answer>", 0.1, 0.0),
        ("<answer>forty-two</answer>", 0.0, 0.0),  # the format reward needs a number
        ("<answer>nan</answer>", 0.0, 0.0),  # float() reads these, but they are no numbers to answer with
        ("<answer>-inf</answer>", 0.0, 0.0),
        ("Put it in <answer></answer> tags.", 0.0, 0.0),
        ("<answer>42</answer> no, <answer>41</answer>", 0.1, 0.0),
        ("42", 0.0, 0.0),
    ],
)
def test_arithmetic(action, reward, score):
    assert step("arithmetic", action, {"answer": "42"}) | {"next_state": None} == {
        "reward": reward, "score": score, "done": True, "next_state": None
    }


def test_calculator_tool_turns_merge_then_answer():
    result = step("calculator", "Let me compute. <calculate>2 * (3 + 4) - -1</calculate>", {"answer": "15"}, state="Q:")
    assert not result["done"] and result["reward"] == 0.0
    assert result["next_state"] == "Q:Let me compute. <calculate>2 * (3 + 4) - -1</calculate>\n<result>15</result>\n"
    unsafe = step("calculator", "<calculate>__import__('os')</calculate>", {"answer": "15"})
    assert "<result>error:" in unsafe["next_state"] and not unsafe["done"]
    assert "division by zero" in step("calculator", "<calculate>1/0</calculate>", {"answer": "1"})["next_state"]
    assert step("calculator", "<answer>15</answer>", {"answer": "15"}) | {"next_state": None} == {
        "reward": 1.0, "score": 1.0, "done": True, "next_state": None
    }
    assert step("calculator", "<answer>14</answer>", {"answer": 15})["reward"] == 0.0
    assert step("calculator", "I give up.", {"answer": 15})["done"]


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1234 * 5678", "7006652"),  # every digit, not 7.00665e+06
        ("99999999 * 99999999", "9999999800000001"),
        ("7 / 2", "3.5"),
        ("10 / 4 * 2", "5"),
        ("1 / 3", "0.333333333333333"),
    ],
)
def test_calculator_results_keep_their_digits(expression, value):
    result = step("calculator", f"<calculate>{expression}</calculate>", {"answer": "0"}, state="Q:")
    assert result["next_state"].endswith(f"\n<result>{value}</result>\n")


def test_math_verify():
    pytest.importorskip("math_verify", reason="math-verify is not installed (pip install math-verify)")
    assert step("math_verify", "So the answer is $\\boxed{\\frac{1}{2}}$.", {"answer": "0.5"})["reward"] == 1.0
    assert step("math_verify", "So the answer is $\\boxed{3}$.", {"answer": "0.5"})["reward"] == 0.0
    assert step("math_verify", "}}\\frac{{ garbage", {"answer": "0.5"})["reward"] == 0.0


# ---- GEM ----


def test_gem_letter_counting_single_turn():
    pytest.importorskip("gem", reason="GEM is not installed (pip install 'RL2[gem]')")
    env = load_env(ENVS / "gem.py")

    async def episode(answer_offset: int):
        extra_info = {"env_id": "rg:letter_counting", "seed": 7}
        messages = await env.reset(extra_info)
        letter, text = re.search(r'letter "(.)" appear in the text: "(.*)"', messages[0]["content"]).groups()
        answer = text.lower().count(letter) + answer_offset
        return await env.step("prompt", f"\\boxed{{{answer}}}", extra_info)

    right, wrong = asyncio.run(episode(0)), asyncio.run(episode(1))
    assert (right.reward, right.done) == (1.0, True)
    assert (wrong.reward, wrong.done) == (0.0, True)


def test_gem_sudoku_keeps_the_conversation():
    pytest.importorskip("gem", reason="GEM is not installed (pip install 'RL2[gem]')")
    env = load_env(ENVS / "gem.py")

    async def episode():
        extra_info = {"env_id": "game:Sudoku-v0-easy", "seed": 3}
        first = list(await env.reset(extra_info))
        again = await env.reset({"env_id": "game:Sudoku-v0-easy", "seed": 3})
        assert again == first and "R1" in first[0]["content"]  # same seed, same board
        out_of_bounds = await env.step("state", "\\boxed{9 9 1}", extra_info)
        invalid = await env.step("state", "no move", extra_info)
        return out_of_bounds, invalid

    out_of_bounds, invalid = asyncio.run(episode())
    assert not out_of_bounds.done and "out of bounds" in out_of_bounds.next_state[-1]["content"]
    assert [m["role"] for m in out_of_bounds.next_state] == ["user", "assistant", "user"]
    assert [m["role"] for m in invalid.next_state] == ["user", "assistant", "user", "assistant", "user"]
    assert invalid.done and "did not provide a valid guess" in invalid.next_state[-1]["content"]


def test_gem_trajectories_reset_at_once_get_the_problem_of_their_seed():
    gem = pytest.importorskip("gem", reason="GEM is not installed (pip install 'RL2[gem]')")
    env = load_env(ENVS / "gem.py")
    env_id, seeds = "game:Sokoban-v0-easy", [1, 2, 1, 2, 1, 2, 1, 2]

    async def resets():  # as a rollout batch runs them: all at once, in threads
        states = await asyncio.gather(*(env.reset({"env_id": env_id, "seed": seed}) for seed in seeds))
        return [state[0]["content"] for state in states]

    def alone(seed: int) -> str:  # GEM's own API, one env at a time
        observation, info = gem.make(env_id, seed=seed).reset(seed=seed)
        return observation + info.get("suffix", "")

    expected = {seed: alone(seed) for seed in set(seeds)}
    assert expected[1] != expected[2]
    assert asyncio.run(resets()) == [expected[seed] for seed in seeds]


def test_gem_game_carried_through_a_checkpoint_goes_on_where_it_was():
    gem = pytest.importorskip("gem", reason="GEM is not installed (pip install 'RL2[gem]')")
    env = load_env(ENVS / "gem.py")
    env_id, moves = "game:Sudoku-v0-easy", ["\\boxed{1 2 1}", "\\boxed{1 4 3}", "\\boxed{1 1 4}"]

    async def first_move():
        extra_info = {"env_id": env_id, "seed": 3}
        await env.reset(extra_info)
        await env.step("state", moves[0], extra_info)
        return extra_info

    # A partial rollout's checkpoint keeps the unfinished trajectory as JSON (trainer_state.json).
    extra_info = asyncio.run(first_move())
    saved = json.dumps(Trajectory(extra_info=extra_info, env_info=extra_info).to_dict())
    restored = Trajectory.from_dict(json.loads(saved)).env_info
    second, third = (asyncio.run(env.step("state", moves[1], restored)),
                     asyncio.run(env.step("state", moves[2], restored)))

    game = gem.make(env_id, seed=3)  # GEM's own API, one game played through
    game.reset(seed=3)
    expected = [game.step(move) for move in moves][1:]
    assert "R1  4  1 |  2  3" in expected[-1][4]["suffix"]  # every move placed a number
    for result, (observation, reward, terminated, truncated, info) in zip([second, third], expected):
        assert result.next_state[-1]["content"] == observation + info.get("suffix", "")
        assert (result.reward, result.done) == (float(reward), terminated or truncated)


def test_gem_missing_download_and_env_id_are_explained(monkeypatch):
    pytest.importorskip("gem", reason="GEM is not installed (pip install 'RL2[gem]')")
    env = load_env(ENVS / "gem.py")
    monkeypatch.delenv("RL2_GEM_ENV", raising=False)
    with pytest.raises(ValueError, match="env id"):
        asyncio.run(env.reset({"seed": 0}))
    # A data-backed id: it fails on a missing package or on the unreachable hub (offline: no retries).
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="could not be created.*Hugging Face hub"):
        asyncio.run(env.reset({"env_id": "math:GSM8K", "seed": 0}))


def test_gem_on_the_tiny_engine(tiny_model_path, tok):
    pytest.importorskip("gem", reason="GEM is not installed (pip install 'RL2[gem]')")
    from RL2.engine.embedded.engine import EmbeddedEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    engine = EmbeddedEngine(model, tok)
    env = load_env(ENVS / "gem.py")
    sampling = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    trajectory = asyncio.run(
        run_trajectory(EnvRollout(engine, env, tok, env_timeout=30), None, {"env_id": "rg:letter_counting", "seed": 1},
                       sampling)
    )
    engine.shutdown()
    assert trajectory.stop_reason == "done" and trajectory.fault is None
    [example] = trajectory.token_sequences()
    assert tok.decode(example["input_ids"]).startswith("<|im_start|>system")  # rendered with the chat template
    assert sum(example["loss_mask"]) == 4
