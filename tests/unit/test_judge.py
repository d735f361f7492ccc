"""The LLM judge (RL2.rewards.judge): its score parser on hand-written answers, a judge at a real HTTP server
speaking the chat-completions protocol through the real openai client (bounded concurrency, scores, and failures
that end a trajectory as a fault), and a frozen copy of the bundled model served as the judge on its own embedded
engine, checked against greedy decoding by the model's own full forwards."""

import asyncio
import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from RL2.config.cli import parse_config
from RL2.config.ppo_schema import JudgeConfig, PPOConfig
from RL2.engine.embedded.engine import EmbeddedEngine
from RL2.models.default_model import resolve_model_path
from RL2.rewards import Judge, JudgeError, judge_reward, openai_chat, parse_score
from RL2.rewards.judge import RUBRICS, load_rubric, use_judge
from RL2.rollout.judge_engine import run_judge
from RL2.rollout.loop import EnvRollout, rollout_batch
from RL2.rollout.metrics import rollout_metrics
from RL2.rollout.reward_env import reward_env
from RL2.trainer.rollout_setup import rollout_worker
from tests.helpers.judge_server import RUBRIC, JudgeServer


@pytest.mark.parametrize("answer, score_range, expected", [
    ("<score>7</score>", (0, 10), 0.7),
    ("The answer is right but terse. <score> 8.5 </score>", (0, 10), 0.85),
    ("First <score>3</score>, on reflection <score>9</score>", (0, 10), 0.9),  # the last tag counts
    ("<score>1</score>", (1, 5), 0.0),
    ("<score>5</score>", (1, 5), 1.0),
    ("<score>+2</score>", (1, 5), 0.25),
    ("<score>11</score>", (0, 10), None),  # outside the range
    ("<score>-1</score>", (0, 10), None),
    ("<score>seven</score>", (0, 10), None),
    ("<score>7/10</score>", (0, 10), None),
    ("<score>7</score> <score>high</score>", (0, 10), None),  # the last tag holds no number
    ("Score: 7", (0, 10), None),
    ("<score>7", (0, 10), None),
    ("", (0, 10), None),
])
def test_parse_score(answer, score_range, expected):
    assert parse_score(answer, score_range) == (pytest.approx(expected) if expected is not None else None)


def test_rubrics_load_from_names_files_and_text_and_bad_ones_are_refused(tmp_path):
    assert load_rubric("correctness")[-1]["content"].startswith("Question: {question}\nReference answer: {reference}")
    messages = [{"role": "system", "content": "Be strict."}, {"role": "user", "content": "Grade {response}"}]
    (tmp_path / "rubric.json").write_text(json.dumps(messages))
    (tmp_path / "rubric.txt").write_text("Grade {response} for {question}")
    assert load_rubric(str(tmp_path / "rubric.json")) == messages
    assert load_rubric(str(tmp_path / "rubric.txt")) == [{"role": "user", "content": "Grade {response} for {question}"}]
    assert load_rubric("Rate {response}") == [{"role": "user", "content": "Rate {response}"}]
    with pytest.raises(ValueError, match="never shows the response"):
        load_rubric("no such rubric")
    with pytest.raises(ValueError, match="end with the user's message"):
        load_rubric([{"role": "user", "content": "{response}"}, {"role": "assistant", "content": "ok"}])
    with pytest.raises(ValueError, match="should be chat messages"):
        load_rubric([{"role": "user"}])


@pytest.fixture(scope="module")
def server():
    server = JudgeServer()
    yield server
    server.stop()


def http_judge(server: JudgeServer, **kwargs) -> Judge:
    return Judge(openai_chat(server.url, "judge", api_key="test"), RUBRIC, **kwargs)


async def scores(judge: Judge, questions: list[str], response: str = "an answer") -> list:
    return await asyncio.gather(*(judge(response, {"question": q}) for q in questions), return_exceptions=True)


def test_an_http_judge_scores_concurrently_within_its_bound(server):
    judge = http_judge(server, max_concurrency=3)
    try:
        assert asyncio.run(scores(judge, ["score 7", "score 10", "score 0"])) == [0.7, 1.0, 0.0]
        server.peak = 0
        # Each request waits until 3 are in flight: a judge admitting fewer would never answer, more would show.
        assert asyncio.run(scores(judge, ["wait 3"] * 9)) == [0.4] * 9
        assert server.peak == 3
        bodies = [(b["model"], b["temperature"], b["messages"]) for b in server.requests]
        assert ("judge", 0.0, [{"role": "user", "content": "Q: score 7\nA: an answer"}]) in bodies
    finally:
        judge.close()


def test_http_failures_are_retried_then_raised_with_their_reason(server):
    judge = http_judge(server, max_retries=1, timeout=0.5)
    try:
        assert asyncio.run(scores(judge, ["once"])) == [0.5]  # a 500, then an answer: retried
        assert server.asked("once") == 2
        fail, hang, text = asyncio.run(scores(judge, ["fail", "hang", "text"]))
        assert isinstance(fail, JudgeError) and "InternalServerError" in str(fail) and "overloaded" in str(fail)
        assert isinstance(hang, JudgeError) and "no answer within 0.5 s" in str(hang)
        assert isinstance(text, JudgeError) and "'Looks fine to me.'" in str(text)
        assert server.asked("fail") == server.asked("hang") == server.asked("text") == 2  # 1 + max_retries
        # A response that writes a placeholder is sent as written, not filled in.
        asyncio.run(judge("{question}", {"question": "score 3"}))
        assert server.requests[-1]["messages"][-1]["content"] == "Q: score 3\nA: {question}"
        with pytest.raises(KeyError, match=r"rubric shows \['question'\] of extra_info, which has \['answer'\]"):
            asyncio.run(judge("x", {"answer": "4"}))
    finally:
        judge.close()


def test_a_failing_judge_ends_its_trajectory_as_a_judge_fault(server, tiny_model_path, tok):
    """Through the real rollout loop: judge_reward on the environments' loop reads the run's judge (use_judge);
    a scored response gets the judge's score, a failed judge call a fault of kind judge, not a reward of 0."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    engine = EmbeddedEngine(model, tok, max_running_requests=4)
    judge = http_judge(server, max_retries=0)
    prompts = [{"prompt": "Hi", "extra_info": {"question": q}} for q in ("score 6", "fail", "text")]
    try:
        with use_judge(judge):
            groups = asyncio.run(rollout_batch(EnvRollout(engine, reward_env(judge_reward), tok), prompts, 1,
                                               {"temperature": 0.0, "max_new_tokens": 3}))
    finally:
        engine.shutdown()
        judge.close()
    scored, failed, unparsable = (group[0] for group in groups)
    assert (scored.fault, scored.reward) == (None, pytest.approx(0.6))
    assert "step raised JudgeError" in failed.fault and "InternalServerError" in failed.fault
    assert "step raised JudgeError" in unparsable.fault and "Looks fine to me." in unparsable.fault
    metrics = rollout_metrics(groups)
    assert (metrics["rollout/faults"], metrics["rollout/faults/judge"]) == (2.0, 2.0)


def test_a_runs_judge_is_made_from_rollout_judge_and_entered_for_its_rollouts(server, tiny_model_path, tok, one_rank,
                                                                              tmp_path):
    (tmp_path / "rubric.txt").write_text(RUBRIC)
    cfg = parse_config(PPOConfig, "ppo", ["rollout.engine=embedded", f"actor.model_name={tiny_model_path}",
                                          "actor.dtype=float32", f"rollout.judge.url={server.url}",
                                          f"rollout.judge.rubric={tmp_path / 'rubric.txt'}"])
    worker = rollout_worker(cfg.rollout, cfg.actor, tok, torch.device("cpu"), reward_env(judge_reward), None)
    try:
        [[trajectory]] = worker.rollout([{"prompt": "Hi", "extra_info": {"question": "score 8"}}],
                                        {"max_new_tokens": 2}, 1, seed=0)
    finally:
        worker.shutdown()
    assert (trajectory.fault, trajectory.reward) == (None, 0.8)
    with pytest.raises(RuntimeError, match="this run has no judge: set rollout.judge.url"):
        asyncio.run(judge_reward("x", {}))  # outside a run's rollout


def test_a_frozen_copy_of_the_bundled_model_judges_and_the_policys_weights_never_reach_it():
    """rollout.judge.model_path: the bundled model, loaded on an engine of the judge's own, writes a greedy answer
    (checked token by token against one full forward of the model) whose score is the reward; zeroing the weights
    of the policy, loaded from the same checkpoint, changes nothing of the judge's."""
    cfg = OmegaConf.merge(OmegaConf.structured(JudgeConfig), {
        "model_path": "smollm2-135m-instruct", "rubric": "correctness", "max_new_tokens": 10, "max_retries": 0})
    judge = run_judge(cfg, torch.float32, torch.device("cpu"))
    path = resolve_model_path("smollm2-135m-instruct")
    tokenizer, policy = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    question, reference, response = "What is 13 - 4?", "9", "13 - 4 = 9. <answer>9</answer>"
    messages = [*RUBRICS["correctness"][:-1], {"role": "user", "content": RUBRICS["correctness"][-1]["content"].format(
        question=question, reference=reference, response=response)}]
    try:
        answer = on_judge_loop(judge, judge.chat(messages))
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
        written = tokenizer.encode(answer, add_special_tokens=False)
        written += [tokenizer.eos_token_id] if len(written) < 10 else []  # it stopped at the end of its turn
        with torch.no_grad():
            logits = policy(torch.tensor([prompt + written])).logits[0, len(prompt) - 1:-1]
        assert logits.argmax(-1).tolist() == written  # every token the judge wrote is the model's greedy choice
        assert parse_score(answer) is not None  # the bundled model follows the rubric's examples
        assert asyncio.run(judge(response, {"question": question, "answer": reference})) == parse_score(answer)
        judge_model = judge.on_close.__self__.runner.model  # run_judge's engine (its shutdown is on_close)
        assert not {id(p) for p in judge_model.parameters()} & {id(p) for p in policy.parameters()}
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.zero_()
        assert on_judge_loop(judge, judge.chat(messages)) == answer
    finally:
        judge.close()


def on_judge_loop(judge: Judge, coroutine):
    """Run `coroutine` on the judge's loop, where its engine runs."""
    return asyncio.run_coroutine_threadsafe(coroutine, judge.loop).result()
