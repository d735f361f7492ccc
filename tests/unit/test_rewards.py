"""The reward library (RL2/rewards) on hand-written responses, plain reward functions as environments,
and reward parts as metrics. The code sandbox has its own file (test_code_reward.py)."""

import asyncio
import functools
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from RL2.rewards import (
    composite,
    extract_code,
    last_boxed,
    last_match,
    last_tag,
    math_reward,
    normalise_answer,
    regex_reward,
    require_math_verify,
    reward_step,
    tags_reward,
)
from RL2.rewards.math_reward import answers_equal
from RL2.rollout.env import EnvError, EnvFault, load_env, parse_step_result
from RL2.rollout.loop import EnvRollout, run_trajectory
from RL2.rollout.metrics import rollout_metrics, save_samples
from RL2.rollout.reward_env import load_reward_env, load_reward_fn, reward_env
from RL2.rollout.trajectory import Trajectory, Turn
from tests.helpers import REPO


@pytest.fixture
def no_math_verify(monkeypatch):
    """Imports of math_verify fail, as when it is not installed."""
    monkeypatch.setitem(sys.modules, "math_verify", None)


# ---- extraction ----


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so $\\boxed{42}$.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one, nested braces
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are not groups
        ("\\boxed{x^{2^{3}}} and more text", "x^{2^{3}}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$", "5"),
        ("so the answer is \\boxed 5.", "5"),  # the sentence's period is not the answer's
        ("\\boxed 3.25, so", "3.25"),
        ("\\boxed{3} and then \\boxed{4", None),  # the last box never closed (cut off)
        ("no box here", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_last_tag_and_last_match():
    assert last_tag("<answer> 1 </answer> <answer>\n2\n</answer>", "answer") == "2"
    assert last_tag("<answer>1", "answer") is None
    assert last_match("Answer: 3. Answer: 4.", r"Answer: (\d+)") == "4"
    assert last_match("a1 b22", r"\d+") == "22"  # no group: the whole match
    assert last_match("nothing", r"\d+") is None


def test_extract_code():
    text = "Idea.\n```\nnot this\n```\n```python\nprint(1)\n```\n```py3\nx\n```\n```Python\nprint(2)\n```\ndone"
    assert extract_code(text) == "print(2)\n"  # the last python fence, whatever the case
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"  # else the last unlabelled fence
    assert extract_code("print(4)") == "print(4)"  # else the whole text


# ---- math ----


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("so $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
        ("\\boxed{3} no, \\boxed{4}", "3", 0.0),  # the last box counts
        ("the answer is 0.5", "0.5", 0.0),  # no box
        ("\\boxed{0.5", "0.5", 0.0),  # cut off
    ],
)
def test_math_reward_with_math_verify(response, answer, reward):
    pytest.importorskip("math_verify", reason="math-verify is not installed (pip install math-verify)")
    assert math_reward(response, {"answer": answer}) == reward


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("so $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),  # a fraction of integers by value
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{ 42 }", "42.0", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
        ("\\boxed{x^2 + 1}", "x^2+1", 1.0),
        ("\\boxed{1 + x^2}", "x^2+1", 0.0),  # no algebra without math-verify
        ("\\boxed{3} no, \\boxed{4}", "3", 0.0),
    ],
)
def test_math_reward_without_math_verify(no_math_verify, response, answer, reward):
    assert math_reward(response, {"answer": answer}) == reward


def test_math_reward_patterns_and_keys(no_math_verify):
    assert math_reward("Final answer: 12", {"answer": 12}, pattern=r"Final answer: (\S+)") == 1.0
    assert math_reward("x", {"gold": "x"}, pattern=r"x", answer_key="gold") == 1.0
    with pytest.raises(KeyError, match="'answer'"):
        math_reward("\\boxed{1}", {"solution": "1"})


def test_math_reward_whole_response():
    pytest.importorskip("math_verify", reason="math-verify is not installed (pip install math-verify)")
    # math-verify picks the answer itself: the last expression when there is no box.
    assert math_reward("so it is 1/2", {"answer": "0.5"}, pattern=None) == 1.0
    assert math_reward("so it is 1/3", {"answer": "0.5"}, pattern=None) == 0.0


@pytest.mark.parametrize(
    "text, normal",
    [("0.50", "0.5"), ("\\frac{1}{2}", "0.5"), ("\\frac12", "0.5"), ("1/2", "0.5"), ("-3.0", "-3"),
     ("\\$1,000.", "1000"), ("10\\%", "10"), ("90^\\circ", "90"), ("\\text{(B)}", "(B)"),
     ("\\left( 1, 2 \\right)", "(1,2)"), ("12,34", "12,34"), ("-\\frac{1}{2}", "-0.5"), ("-\\dfrac34", "-0.75")],
)
def test_normalise_answer(text, normal):
    assert normalise_answer(text) == normal


def test_require_math_verify_names_the_package(no_math_verify):
    with pytest.raises(ImportError, match="pip install math-verify"):
        require_math_verify()
    env = load_env(REPO / "envs" / "math_verify.py")
    with pytest.raises(ImportError, match="math-verify"):  # the env needs math-verify's own extraction
        asyncio.run(env.step("", "\\boxed{1}", {"answer": "1"}))


def test_answers_equal_uses_math_verify_when_installed():
    pytest.importorskip("math_verify", reason="math-verify is not installed (pip install math-verify)")
    assert answers_equal("1 + x^2", "x^2 + 1")  # symbolic: the normalised strings differ
    assert normalise_answer("1 + x^2") != normalise_answer("x^2 + 1")


# ---- format ----


@pytest.mark.parametrize(
    "response, reward",
    [
        ("<think>a</think><answer>b</answer>", 1.0),
        ("  <think>\na\n</think>\n<answer>b</answer>\n", 1.0),
        ("Sure! <think>a</think><answer>b</answer>", 0.5),  # both tags, text outside them
        ("<answer>b</answer><think>a</think>", 0.5),  # both tags, wrong order
        ("<think>a</think>", 0.25),
        ("<think>a</think><think>b</think><answer>c</answer>", 0.25),  # think twice: not well formed
        ("</think>a<think><answer>b</answer>", 0.25),  # closed before opened
        ("plain text", 0.0),
    ],
)
def test_tags_reward(response, reward):
    assert tags_reward(response) == reward


def test_tags_reward_three_tags():
    tags = ("plan", "code", "answer")
    assert tags_reward("<plan>p</plan><code>c</code><answer>a</answer>", tags=tags) == 1.0
    assert tags_reward("<plan>p</plan> <code>c</code>", tags=tags) == pytest.approx(1 / 3)


def test_regex_reward():
    assert regex_reward("Answer: 12", pattern=r"Answer: \d+") == 1.0
    assert regex_reward("So. Answer: 12", pattern=r"Answer: \d+", fullmatch=True) == 0.0
    assert regex_reward("a\nb", pattern=r"a.b", fullmatch=True) == 1.0  # `.` matches newlines


# ---- composite ----


async def _async_half(response: str, extra_info: dict) -> float:
    return 0.5


def test_composite_weights_parts_and_score(no_math_verify):
    reward = composite({"correct": (1.0, math_reward), "format": (0.2, tags_reward), "half": (2.0, _async_half)},
                       score="correct")
    result = asyncio.run(reward("<think>t</think><answer>\\boxed{7}</answer>", {"answer": "7"}))
    assert result == {"reward": 1.0 + 0.2 * 1.0 + 2.0 * 0.5, "score": 1.0, "correct": 1.0, "format": 1.0, "half": 0.5}
    wrong = asyncio.run(reward("<think>t</think> \\boxed{8}", {"answer": "7"}))
    assert wrong == {"reward": 0.2 * 0.25 + 1.0, "score": 0.0, "correct": 0.0, "format": 0.25, "half": 0.5}


def test_composite_nests_dict_parts_and_checks_names():
    inner = composite({"a": (1.0, lambda r, e: 2.0), "b": (1.0, lambda r, e: 3.0)})
    outer = composite({"inner": (0.5, inner), "c": (1.0, lambda r, e: 1.0)})
    assert asyncio.run(outer("", {})) == {"reward": 0.5 * 5.0 + 1.0, "score": 3.5, "inner/a": 2.0, "inner/b": 3.0,
                                           "inner": 5.0, "c": 1.0}
    with pytest.raises(ValueError, match="'reward'"):
        composite({"reward": (1.0, tags_reward)})
    with pytest.raises(ValueError, match="score='x'"):
        composite({"format": (1.0, tags_reward)}, score="x")


# ---- reward functions as environments ----


def test_reward_step_and_validation():
    assert reward_step(0.5, {"id": 1}) == {"next_state": None, "reward": 0.5, "score": 0.5, "done": True,
                                            "extra_info": {"id": 1}, "reward_parts": {}}
    step = reward_step({"reward": 1.2, "score": 1.0, "format": 0.2}, {})
    assert (step["reward"], step["score"], step["reward_parts"]) == (1.2, 1.0, {"format": 0.2})
    assert parse_step_result(step, {}).reward_parts == {"format": 0.2}
    with pytest.raises(ValueError, match="'reward' entry"):
        reward_step({"format": 1.0}, {})
    for parts in ({"format": float("nan")}, {"format": "high"}, [1.0]):
        with pytest.raises(EnvFault, match="reward_parts"):
            parse_step_result({"reward": 1.0, "done": True, "reward_parts": parts}, {})


def test_reward_env_sync_async_and_dict():
    async def async_fn(response, extra_info):
        return {"reward": len(response) + extra_info["bonus"], "length": float(len(response))}

    for function, reward, parts in ((lambda r, e: float(r == "ok"), 1.0, {}), (async_fn, 3.0, {"length": 2.0})):
        result = asyncio.run(reward_env(function).step("state", "ok", {"bonus": 1}))
        assert (result.reward, result.done, result.reward_parts) == (reward, True, parts)


def test_load_reward_fn(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text("def reward(response, extra_info):\n    return 1.0\n\n"
                    "def scored(response, extra_info):\n    return 2.0\n\n"
                    "def no_args():\n    return 0.0\n")
    assert load_reward_fn(f"{file}")("", {}) == 1.0  # the name defaults to `reward`
    assert load_reward_fn(f"{file}:scored")("", {}) == 2.0
    assert load_reward_fn("RL2.rewards:math_reward") is math_reward  # a module path
    partial = functools.partial(tags_reward, tags=("a",))
    assert asyncio.run(reward_env(partial).step("", "<a>x</a>", {})).reward == 1.0
    with pytest.raises(EnvError, match="does not exist"):
        load_reward_fn(f"{tmp_path}/missing.py:reward")
    with pytest.raises(EnvError, match="no function 'other'"):
        load_reward_fn(f"{file}:other")
    with pytest.raises(EnvError, match="must accept"):
        load_reward_fn(f"{file}:no_args")
    with pytest.raises(EnvError, match="cannot import module 'no_such_module'"):
        load_reward_fn("no_such_module:reward")


def test_reward_fn_on_the_tiny_engine(tiny_model_path, tok, tmp_path):
    """The function sees exactly the decoded action; one that raises ends its trajectory with reward 0."""
    from RL2.engine.embedded.engine import EmbeddedEngine

    file = tmp_path / "seen.py"
    file.write_text(
        "def reward(response, extra_info):\n"
        "    if extra_info.get('fail'):\n"
        "        raise RuntimeError('the grader broke')\n"
        "    with open(extra_info['log'], 'w') as f:\n"
        "        f.write(response)\n"
        "    return {'reward': 0.25, 'length': float(len(response))}\n"
    )
    env = load_reward_env(f"{file}:reward")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    engine = EmbeddedEngine(model, tok)
    sampling = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    log = tmp_path / "seen.txt"
    try:
        good = asyncio.run(run_trajectory(EnvRollout(engine, env, tok), "Say something.", {"log": str(log)}, sampling))
        bad = asyncio.run(run_trajectory(EnvRollout(engine, env, tok), "Say something.", {"fail": True}, sampling))
    finally:
        engine.shutdown()
    [turn] = good.turns
    assert log.read_text() == turn.action_text == tok.decode(turn.action_ids, skip_special_tokens=True)
    assert (good.reward, good.stop_reason, turn.reward_parts) == (
        0.25, "done", {"length": float(len(turn.action_text))})
    assert (bad.reward, bad.stop_reason) == (0.0, "fault") and "the grader broke" in bad.fault
    assert bad.turns[0].reward_parts == {}


# ---- reward parts as metrics ----


def _trajectory(turn_parts: list[dict], fault: str | None = None) -> Trajectory:
    trajectory = Trajectory(extra_info={})
    trajectory.start_sequence("p", [1])
    for parts in turn_parts:
        trajectory.add_turn(Turn([2], [0.0], "a", "stop", reward=sum(parts.values()), reward_parts=dict(parts)))
    if fault:
        trajectory.fail(fault)
    return trajectory


def test_reward_parts_become_metrics(tmp_path):
    groups = [
        [_trajectory([{"format": 0.5, "correct": 1.0}]), _trajectory([{"format": 1.0}])],
        [_trajectory([{"format": 0.25}, {"format": 0.25, "correct": 1.0}]), _trajectory([{"format": 1.0}], fault="x")],
    ]
    metrics = rollout_metrics(groups)
    # Per trajectory summed over turns, averaged over all four (missing and faulted count 0).
    assert metrics["rollout/reward/format"] == pytest.approx((0.5 + 1.0 + 0.5 + 0.0) / 4)
    assert metrics["rollout/reward/correct"] == pytest.approx((1.0 + 0.0 + 1.0 + 0.0) / 4)
    assert metrics["rollout/reward"] == pytest.approx(metrics["rollout/reward/format"]
                                                      + metrics["rollout/reward/correct"])
    assert not any(key.startswith("rollout/reward/") for key in rollout_metrics([[_trajectory([{}])]]))
    save_samples(tmp_path / "samples.jsonl", groups[:1], step=1)
    assert '"reward_parts": {"format": 0.5, "correct": 1.0}' in (tmp_path / "samples.jsonl").read_text()


def test_reward_parts_survive_a_checkpoint():
    trajectory = _trajectory([{"format": 0.5}])
    assert Trajectory.from_dict(trajectory.to_dict()).turns[0].reward_parts == {"format": 0.5}
    older = trajectory.to_dict()
    del older["sequences"][0]["turns"][0]["reward_parts"]  # written before reward parts existed
    assert Trajectory.from_dict(older).turns[0].reward_parts == {}
