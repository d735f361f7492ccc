"""Rollout layer on the real embedded engine serving a tiny random Llama (greedy decoding).

Expected token ids come from an independent greedy loop over full forwards of the same model, and
expected log-probabilities from one full forward over the finished sequence.
"""

import asyncio
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from RL2.engine.embedded.engine import EmbeddedEngine
from RL2.engine.protocol import EngineError
from RL2.engine.sglang.http_client import HTTPEngineClient
from RL2.engine.sglang.server import free_port
from RL2.rollout.env import EnvError, EnvFault, load_env, parse_step_result
from RL2.rollout.event_loop import env_loop, run_on_rank_loop
from RL2.rollout.loop import (
    EnvRollout,
    continuation,
    drop_stale_groups,
    filter_groups,
    partial_rollout_batch,
    rollout_batch,
    run_trajectory,
)
from RL2.rollout.metrics import evaluation_metrics, pass_at_k, rollout_metrics, save_samples, staleness_metrics
from RL2.rollout.trajectory import Trajectory, Turn, training_batch, weight_version_number
from tests.helpers import ENVS
from tests.helpers.engines import CutOnce
from tests.helpers.http import LocalServer, response_head
from tests.helpers.reference import greedy, token_logps

GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model, tok):
    engine = EmbeddedEngine(model, tok, max_running_requests=16)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompt(tok) -> str:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


SETTINGS = ("max_turns", "max_total_tokens", "env_timeout")  # of `EnvRollout`; the rest are run_trajectory's


def roll(engine, tok, env_name, state, extra_info, **kwargs) -> Trajectory:
    kwargs = {"sampling_params": GREEDY, "max_turns": 8} | kwargs
    settings = {key: kwargs.pop(key) for key in SETTINGS if key in kwargs}
    env = load_env(ENVS / f"{env_name}.py")
    return asyncio.run(run_trajectory(EnvRollout(engine, env, tok, **settings), state, extra_info, **kwargs))


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# ---- token layout ----


def test_turns_that_extend_the_text_form_one_example(engine, model, tok, prompt):
    trajectory = roll(engine, tok, "echo", prompt, {"turns": 3})
    assert (trajectory.n_turns, trajectory.stop_reason, trajectory.reward) == (3, "done", 3.0)
    [example] = trajectory.token_sequences()

    expected = encode(tok, prompt)
    turn_ids = [-1] * len(expected)
    for turn in range(3):
        expected += greedy(model, expected, 4)
        turn_ids += [turn] * 4
        if turn < 2:
            observation = encode(tok, f"\nobservation {turn + 1}\n")
            expected += observation
            turn_ids += [-1] * len(observation)
    action_positions = [i for i, t in enumerate(turn_ids) if t >= 0]
    assert example["input_ids"] == expected
    assert example["turn_ids"] == turn_ids
    assert [i for i, m in enumerate(example["loss_mask"]) if m] == action_positions
    reference = token_logps(model, expected)
    for i, logp in enumerate(example["engine_logps"]):
        assert logp == pytest.approx(reference[i], abs=1e-4) if i in action_positions else logp == 0.0
    assert [turn.reward for turn in trajectory.turns] == [1.0, 1.0, 1.0]
    assert all(len(example[k]) == len(expected) for k in ("loss_mask", "engine_logps", "turn_ids"))


def test_fresh_states_start_new_sequences(engine, model, tok, prompt):
    trajectory = roll(engine, tok, "restart", prompt, {"turns": 3})
    examples = trajectory.token_sequences()
    assert len(examples) == 3 and trajectory.n_turns == 3
    rewards = []
    for turn, (example, state) in enumerate(zip(examples, [prompt, "Question 1: go on.", "Question 2: go on."])):
        ids = encode(tok, state)
        action = greedy(model, ids, 4)
        assert example["input_ids"] == ids + action
        assert example["loss_mask"] == [0] * len(ids) + [1] * 4
        assert example["turn_ids"] == [-1] * len(ids) + [turn] * 4
        rewards.append(float(len(tok.decode(action, skip_special_tokens=True)) % 2))  # restart.py's reward
    assert [turn.reward for turn in trajectory.turns] == rewards
    assert (trajectory.reward, trajectory.score) == (sum(rewards), 3.0)


def test_chat_messages_continue_one_sequence(engine, model, tok):
    trajectory = roll(engine, tok, "chat", None, {"question": "Hi", "turns": 2})
    [example] = trajectory.token_sequences()
    state = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    first = greedy(model, encode(tok, state), 4)
    assert first[-1] not in tok.all_special_ids  # the observation then starts with the end of the turn
    observation = "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
    ids = encode(tok, state) + first + encode(tok, observation)
    assert example["input_ids"] == ids + greedy(model, ids, 4)


def test_continuation_does_not_repeat_the_sampled_end_of_turn(tok):
    messages = [{"role": "user", "content": "Hi"}]
    state = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    later = messages + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More."}]
    next_state = tok.apply_chat_template(later, add_generation_prompt=True, tokenize=False)
    added = continuation(state, "Hello!", next_state, end_text="<|im_end|>")
    assert added == "\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n"
    # Sampled ids (ending in <|im_end|>) plus the added text tokenise exactly as the whole conversation.
    sampled = encode(tok, "Hello!") + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert encode(tok, state) + sampled + encode(tok, added) == encode(tok, next_state)
    assert continuation(state, "Hello!", "something else") is None


# ---- stopping and faults ----


def test_max_turns_and_token_budget_stop(engine, model, tok, prompt):
    assert roll(engine, tok, "echo", prompt, {}, max_turns=3).stop_reason == "max_turns"
    prompt_len, observation_len = len(encode(tok, prompt)), len(encode(tok, "\nobservation 1\n"))
    budget = prompt_len + 4 + observation_len + 2
    trajectory = roll(engine, tok, "echo", prompt, {}, max_total_tokens=budget)
    assert trajectory.stop_reason == "budget" and trajectory.n_turns == 2
    assert [len(t.action_ids) for t in trajectory.turns] == [4, 2]
    assert trajectory.turns[-1].finish_reason == "length"
    assert len(trajectory.token_sequences()[0]["input_ids"]) == budget
    with pytest.raises(ValueError, match="leaves no room"):
        roll(engine, tok, "echo", prompt, {}, max_total_tokens=prompt_len)


def first_stop(tok, ids: list[int], stop: str) -> int:
    """How many of `ids` a request stopped by `stop` samples: the shortest prefix whose text holds it."""
    return next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))


SAMPLED = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 7}  # the tiny model's greedy text is all newlines


def test_a_stop_string_ends_the_action_which_ends_with_it(engine, tok, prompt):
    free = roll(engine, tok, "echo", prompt, {}, max_turns=1, sampling_params=SAMPLED).turns[0].action_ids
    plain = [j for j in range(3, 10) if not {free[j], free[j + 1]} & set(tok.all_special_ids)
             and len(tok.decode(free[j:j + 2]).strip()) > 2]
    # One character short of two tokens' text: the token that completes the stop writes more after it.
    stop = tok.decode(free[plain[0]:plain[0] + 2])[:-1]
    n = first_stop(tok, free, stop)
    trajectory = roll(engine, tok, "echo", prompt, {}, max_turns=1,
                      sampling_params=SAMPLED | {"stop": [stop, "never written"]})
    [turn] = trajectory.turns
    assert turn.action_ids == free[:n] and turn.finish_reason == "stop"  # every sampled token, the stop's too
    written = tok.decode(free[:n], skip_special_tokens=True)
    assert turn.action_text == written[: written.index(stop) + len(stop)] and turn.action_text.endswith(stop)
    assert written != turn.action_text
    assert trajectory.token_sequences()[0]["loss_mask"][-n:] == [1] * n


def test_a_stop_token_ends_the_action(engine, tok, prompt):
    free = roll(engine, tok, "echo", prompt, {}, max_turns=1, sampling_params=SAMPLED).turns[0].action_ids
    n = next(k for k, token in enumerate(free, 1) if token == free[3] or token == tok.eos_token_id)
    params = SAMPLED | {"stop_token_ids": [free[3]]}
    [turn] = roll(engine, tok, "echo", prompt, {}, max_turns=1, sampling_params=params).turns
    assert turn.action_ids == free[:n] and turn.finish_reason == "stop"


def test_environment_code_runs_on_one_loop_so_module_level_asyncio_objects_keep_working(engine, tok, prompt):
    env = load_env(ENVS / "emit_token.py")  # its steps queue for a semaphore made at import
    for run in (run_on_rank_loop, run_on_rank_loop, asyncio.run):  # a caller's own loop too
        [group] = run(rollout_batch(EnvRollout(engine, env, tok), [{"prompt": prompt}], 4, GREEDY))
        assert [t.fault for t in group] == [None] * 4
    assert env.step_fn.__globals__["ONE_AT_A_TIME"]._loop is env_loop()


@pytest.mark.parametrize(
    "fault, message",
    [
        ("raise", "step raised KeyError: 'broken env'"),
        ("sleep", "timed out after 0.05 s"),
        ("malformed", "reward='high'"),
        ("unrenderable", "the chat template raised TypeError"),
        ("empty", "next_state is empty (done is False)"),
        ("exit", "step raised SystemExit: 3"),  # sys.exit() in a step ends the trajectory, not the trainer
        ("block", "timed out after 0.05 s"),  # a timeout holds for blocking code in an async step
    ],
)
def test_env_faults_end_one_trajectory_with_reward_0(engine, tok, prompt, fault, message):
    trajectory = roll(engine, tok, "faulty", prompt, {"fault": fault, "after": 1}, env_timeout=0.05)
    assert trajectory.stop_reason == "fault" and message in trajectory.fault
    assert trajectory.n_turns == 2 and trajectory.reward == 0.0  # the first turn's reward 1 is dropped too
    assert [t.reward for t in trajectory.turns] == [0.0, 0.0]
    assert rollout_metrics([[trajectory]])["rollout/faults"] == 1.0


def test_a_blocking_step_stops_neither_the_engine_nor_the_other_trajectories_timeouts(engine, tok, prompt):
    # Three steps that each block for 1 s under a 0.2 s limit, and a fourth trajectory that never blocks.
    env = load_env(ENVS / "faulty.py")
    rows = [{"prompt": prompt, "extra_info": {"fault": "block", "block_s": 1.0}}] * 3 + [
        {"prompt": prompt, "extra_info": {"fault": "none"}}]
    groups = asyncio.run(rollout_batch(EnvRollout(engine, env, tok, max_turns=2, env_timeout=0.2), rows, 1, GREEDY))
    faults = [group[0].fault for group in groups]
    assert faults[:3] == ["step timed out after 0.2 s"] * 3  # in series they would have scored 1.0 each
    assert groups[3][0].reward == 1.0  # its time counts from when it starts, on a loop no blocked step holds


@pytest.mark.parametrize("reset_fault, message", [
    ("raise", "reset raised ConnectionError: no game server"),
    ("exit", "reset raised SystemExit: 4"),
    ("unrenderable", "malformed state: the chat template raised TypeError: "
                     'can only concatenate str (not "int") to str'),
])
def test_a_failing_reset_ends_its_own_trajectory(engine, tok, reset_fault, message):
    env = load_env(ENVS / "faulty.py")
    rows = [{"prompt": None, "extra_info": {"reset_fault": reset_fault}},
            {"prompt": None, "extra_info": {"fault": "none"}}]
    [[failed], [fine]] = asyncio.run(rollout_batch(EnvRollout(engine, env, tok, max_turns=2), rows, 1, GREEDY))
    assert (failed.fault, failed.n_turns, failed.sequences) == (message, 0, [])
    assert fine.fault is None and fine.reward == 1.0
    assert training_batch([[failed, fine]]).trained.tolist() == [False, True]  # a fault is left out of training


class EncodeRecorder:
    """The tokenizer, recording the longest text it was asked to encode."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def encode(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tok.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_an_observation_past_the_token_budget_is_cut_before_it_is_tokenised(engine, tok, prompt):
    recorder = EncodeRecorder(tok)
    budget = len(encode(tok, prompt)) + 64
    trajectory = roll(engine, recorder, "faulty", prompt, {"fault": "huge"}, max_total_tokens=budget)
    assert (trajectory.stop_reason, trajectory.n_turns) == ("budget", 1)
    assert recorder.longest < 100_000  # not the 20 MB observation


def test_step_result_validation():
    parsed = parse_step_result({"next_state": "s", "reward": 1, "done": False}, {"a": 1})
    assert (parsed.score, parsed.extra_info) == (1.0, {"a": 1})
    for bad in [None, {"reward": 1.0}, {"reward": float("nan"), "done": True}, {"reward": 1.0, "done": "yes"},
                {"reward": 1.0, "done": False}, {"reward": 1.0, "done": True, "extra_info": []}]:
        with pytest.raises(EnvFault):
            parse_step_result(bad, {})


def test_load_env_errors(tmp_path):
    with pytest.raises(EnvError, match="does not exist"):
        load_env(tmp_path / "missing.py")
    (tmp_path / "no_step.py").write_text("async def reset(extra_info):\n    return 'hi'\n")
    with pytest.raises(EnvError, match="defines no `step`"):
        load_env(tmp_path / "no_step.py")
    (tmp_path / "sync_step.py").write_text("def step(state, action, extra_info):\n    return {}\n")
    with pytest.raises(EnvError, match="must be async"):
        load_env(tmp_path / "sync_step.py")
    (tmp_path / "two_args.py").write_text("async def step(state, action):\n    return {}\n")
    with pytest.raises(EnvError, match=r"two_args\.py: `step` must accept \(state, action, extra_info\): "
                                       r"too many positional arguments"):
        load_env(tmp_path / "two_args.py")
    (tmp_path / "no_reset_arg.py").write_text("async def step(s, a, info):\n    return {}\n"
                                              "async def reset():\n    return ''\n")
    with pytest.raises(EnvError, match=r"no_reset_arg\.py: `reset` must accept \(extra_info\)"):
        load_env(tmp_path / "no_reset_arg.py")
    with pytest.raises(EnvError, match="defines no `reset`"):
        asyncio.run(load_env(ENVS / "echo.py").reset({}))
    (tmp_path / "empty_reset.py").write_text("async def step(s, a, info):\n    return {}\n"
                                             "async def reset(info):\n    return ''\n")
    # the row's extra_info with the number the original RL2's scripts read (`idx`)
    with pytest.raises(EnvError, match=r"empty_reset\.py: reset returned an empty state for "
                                       r"extra_info=\{'id': 3, 'idx': 0\}"):
        asyncio.run(load_env(tmp_path / "empty_reset.py").reset({"id": 3}))


# ---- batches, filtering, metrics, samples ----


def test_rollout_batch_groups_with_own_extra_info(engine, tok, prompt):
    prompts = [{"prompt": prompt, "extra_info": {"turns": 2}}, {"prompt": "Count: 1 2 3", "extra_info": {"turns": 1}}]
    sampling = {"temperature": 1.0, "max_new_tokens": 3}
    env = load_env(ENVS / "echo.py")
    groups = asyncio.run(rollout_batch(EnvRollout(engine, env, tok, max_turns=4), prompts, 3, sampling))
    assert [[t.n_turns for t in group] for group in groups] == [[2, 2, 2], [1, 1, 1]]
    assert [t.extra_info["seen"] for group in groups for t in group] == [2, 2, 2, 1, 1, 1]
    assert prompts[0]["extra_info"] == {"turns": 2}  # the rows themselves are untouched


def test_engine_errors_stop_the_batch(engine, tok, prompt):
    env = load_env(ENVS / "echo.py")
    with pytest.raises(ValueError, match="unknown sampling params"):
        asyncio.run(rollout_batch(EnvRollout(engine, env, tok), [{"prompt": prompt}], 2, {"bogus": 1}))
    dead = HTTPEngineClient([f"http://127.0.0.1:{free_port()}"], timeout=5)
    with pytest.raises(EngineError, match="unreachable"):
        asyncio.run(rollout_batch(EnvRollout(dead, env, tok), [{"prompt": prompt}], 2, GREEDY))


def test_a_server_that_never_answers_fails_after_rollout_request_timeout(tmp_path):
    import socket

    from RL2.config import parse_config
    from RL2.config.ppo_schema import PPOConfig
    from RL2.engine.sglang.engine import SGLangEngine

    cfg = parse_config(PPOConfig, "ppo", ["rollout.request_timeout=0.5"])
    with socket.socket() as silent:  # accepts the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        engine = SGLangEngine([url], [], "none", 1, str(tmp_path), request_timeout=cfg.rollout.request_timeout)
        with pytest.raises(EngineError, match=r"/generate: no answer within 0\.5 s"):
            asyncio.run(engine.generate({"input_ids": [1, 2], "sampling_params": {}}))


def made(rewards: list[float], scores: list[float] | None = None, source: str = "math") -> list[Trajectory]:
    """A group of one-turn trajectories built by hand."""
    group = []
    for i, reward in enumerate(rewards):
        t = Trajectory(extra_info={"data_source": source})
        t.start_sequence("p", [1, 2])
        finish = "length" if i == 0 else "stop"
        t.add_turn(Turn([3] * (i + 1), [-0.5] * (i + 1), "a", finish, reward, (scores or rewards)[i]))
        t.stop_reason = "done"
        group.append(t)
    return group


def test_filter_groups_drops_groups_with_equal_rewards():
    groups = [made([1.0, 1.0]), made([0.0, 1.0]), made([0.0, 0.0]), made([0.1, 0.0])]
    assert filter_groups(groups) == [groups[1], groups[3]]


def test_metrics_by_hand():
    groups = [made([1.0, 0.0, 0.0, 0.0]), made([0.1, 0.1, 0.1, 0.1], [0.0] * 4), made([1.0] * 4, source="code")]
    metrics = rollout_metrics(groups)
    assert metrics["rollout/reward"] == pytest.approx((1.0 + 0.4 + 4.0) / 12)
    assert metrics["rollout/score"] == pytest.approx(5 / 12)
    assert metrics["rollout/response_length"] == pytest.approx(2.5)
    assert metrics["rollout/clip_ratio"] == pytest.approx(3 / 12)
    assert (metrics["rollout/n_turns"], metrics["rollout/faults"]) == (1.0, 0.0)
    by_source = evaluation_metrics(groups, ["math", "math", "code"], [4], threshold=1.0)["by_source"]
    assert by_source["math"]["score"] == pytest.approx(1 / 8)
    assert by_source["math"]["pass@4"] == pytest.approx(0.5)  # one group of two passes
    assert by_source["code"]["pass@4"] == 1.0
    # pass@2 of a group with 1 correct of 4: 1 - C(3,2)/C(4,2) = 1/2.
    assert evaluation_metrics(groups[:1], ["math"], [2], 1.0)["overall"]["pass@2"] == pytest.approx(0.5)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0


def test_save_samples_appends_jsonl(tmp_path):
    path = tmp_path / "samples" / "rollout.jsonl"
    save_samples(path, [made([1.0, 0.0])], step=1)
    save_samples(path, [made([0.5])], step=2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["group"], r["reward"]) for r in records] == [(1, 0, 1.0), (1, 0, 0.0), (2, 0, 0.5)]
    assert {"prompt", "response", "score", "finish_reason", "fault"} <= set(records[0])


# ---- HTTP client against a real HTTP server speaking /generate ----


class GenerateServer(LocalServer):
    """A minimal HTTP/1.1 server that answers `POST /generate` with the embedded engine."""

    def __init__(self, engine, delay: float = 0.0):
        self.engine, self.delay, self.hits = engine, delay, 0

    async def respond(self, head: bytes, body: bytes, writer) -> None:
        payload = json.loads(body)
        self.hits += 1
        await asyncio.sleep(self.delay)
        try:
            status, reply = 200, await self.engine.generate(payload)
        except ValueError as e:  # SGLang answers a bad request with 400 and a message
            status, reply = 400, {"error": {"message": str(e)}}
        body = json.dumps(reply).encode()
        writer.write(response_head(status, len(body)) + body)
        await writer.drain()
        writer.close()


def test_http_client_balances_and_matches_the_engine(engine, tok, prompt):
    ids = encode(tok, prompt)
    payload = {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True}

    async def main():
        async with GenerateServer(engine) as a, GenerateServer(engine) as b:
            client = HTTPEngineClient([a.url, b.url + "/"], timeout=30)
            results = await asyncio.gather(*(client.generate(payload) for _ in range(4)))
            await client.aclose()
            return results, (a.hits, b.hits), await engine.generate(payload)

    results, hits, direct = asyncio.run(main())
    assert hits == (2, 2)
    assert all(r["output_ids"] == direct["output_ids"] for r in results)
    # The four ran as one batch, the direct one alone: their logprobs agree to round-off.
    for logprob, expected in zip(results[0]["meta_info"]["output_token_logprobs"],
                                 direct["meta_info"]["output_token_logprobs"], strict=True):
        assert logprob[1:] == expected[1:] and logprob[0] == pytest.approx(expected[0], abs=1e-5)


def test_tokens_keep_the_weight_version_a_server_names(engine, tok, prompt):
    """An SGLang server names the weights that answered in meta_info.weight_version (the name of its last
    push), as the embedded engine does: a rollout over HTTP gives it to every sampled token."""

    async def main():
        async with GenerateServer(engine) as server:
            client = HTTPEngineClient([server.url], timeout=30)
            groups = await rollout_batch(EnvRollout(client, load_env(ENVS / "echo.py"), tok, max_turns=2),
                                         [{"prompt": prompt, "extra_info": {"turns": 2}}], 2, GREEDY)
            await client.aclose()
            return groups

    engine.weight_version = "step7"
    try:
        [group] = asyncio.run(main())
    finally:
        engine.weight_version = "default"
    assert all(t.versions == [7] * t.response_length and t.response_length == 8 for t in group)


def test_http_client_errors_name_the_server(engine):
    async def main():
        async with GenerateServer(engine) as ok, GenerateServer(engine, delay=10) as slow:
            with pytest.raises(EngineError, match=rf"{ok.url}/generate returned HTTP 400: .*input_ids is empty"):
                await HTTPEngineClient([ok.url]).generate({"input_ids": [], "sampling_params": GREEDY})
            with pytest.raises(EngineError, match=rf"{slow.url}/generate: no answer within 0.2 s"):
                await HTTPEngineClient([slow.url], timeout=0.2).generate({"input_ids": [1]})
        port = free_port()
        with pytest.raises(EngineError, match=rf"127.0.0.1:{port}/generate is unreachable"):
            await HTTPEngineClient([f"http://127.0.0.1:{port}"]).generate({"input_ids": [1]})

    asyncio.run(main())


# ---- partial rollout ----


def test_partial_rollout_resumes_aborted_trajectories_exactly(model, tok):
    """Trajectories cut by the pause and resumed (after a JSON round trip, as a checkpoint keeps them)
    end with the tokens, masks, rewards and log-probabilities of an uninterrupted greedy rollout, also
    when the pause cut them in an earlier turn than their last. Every token keeps the weight_version the
    engine named when it sampled it (renamed before each resume, as a push does): an action cut by the
    pause spans two versions."""
    env = load_env(ENVS / "echo.py")
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    # The one-turn row finishes first and so sets off the pause while the others are in turn 1 or 2.
    rows = [{"prompt": f"Question {i}: count to {i}.", "extra_info": {"turns": 1 if i == 0 else 3}} for i in range(4)]
    engine = EmbeddedEngine(model, tok, max_running_requests=2)  # few at a time: most are cut by the pause
    try:
        finished, carried, _ = asyncio.run(partial_rollout_batch(EnvRollout(engine, env, tok, max_turns=3),
                                                                 [], rows, 1, 1, params))
        assert len(finished) >= 1 and carried, "the pause should leave unfinished trajectories"
        assert all(t.stop_reason == "abort" for g in carried for t in g if t.unfinished)
        assert any(t.n_turns < 3 for g in carried for t in g), "the pause should cut a trajectory before its last turn"
        assert all(set(t.versions) == {0} for g in finished + carried for t in g)  # "default": the first weights
        rounds = 0
        while carried:
            engine.weight_version = f"step{rounds + 1}"  # as the push after an update names the weights
            carried = [[Trajectory.from_dict(json.loads(json.dumps(t.to_dict()))) for t in g] for g in carried]
            more, carried, _ = asyncio.run(partial_rollout_batch(EnvRollout(engine, env, tok, max_turns=3),
                                                                 carried, [], 1, 1, params))
            finished += more
            rounds += 1
        assert rounds >= 1 and len(finished) == len(rows)
    finally:
        engine.shutdown()
    spans = [turn.action_versions for g in finished for turn in g[0].turns if len(set(turn.action_versions)) > 1]
    assert spans, "an action cut by the pause and resumed should span two versions"
    for versions in spans:
        assert versions == sorted(versions) and versions[-1] == versions[0] + 1  # resumed by the next round
    for group in finished:
        [trajectory] = group
        turns = trajectory.extra_info["turns"]
        assert (trajectory.n_turns, trajectory.stop_reason) == (turns, "done")
        assert all(len(turn.action_versions) == len(turn.action_ids) for turn in trajectory.turns)
        assert [turn.reward for turn in trajectory.turns] == [1.0] * turns
        expected = roll_fresh(model, tok, env, trajectory.prompt_text, params, turns)
        [got], [want] = trajectory.token_sequences(), expected.token_sequences()
        assert got["input_ids"] == want["input_ids"]
        assert got["loss_mask"] == want["loss_mask"] and got["turn_ids"] == want["turn_ids"]
        reference = token_logps(model, got["input_ids"])
        for logp, ref, mask in zip(got["engine_logps"], reference, got["loss_mask"]):
            assert logp == (pytest.approx(ref, abs=1e-4) if mask else 0.0)


def versioned(*turns: list[int]) -> Trajectory:
    """A one-sequence trajectory of a 2-token prompt and one turn per list of token versions (one token
    each; -1: a token the engine sampled without naming its weights)."""
    trajectory = Trajectory(extra_info={})
    trajectory.start_sequence("p", [1, 2])
    for versions in turns:
        known = [v for v in versions if v >= 0]
        trajectory.add_turn(Turn([7] * len(versions), [-0.5] * len(versions), "a", "stop", action_versions=known))
    return trajectory


def test_weight_versions_are_the_trainer_steps_that_made_the_weights():
    assert [weight_version_number(name) for name in ("step0", "step12", "default")] == [0, 12, 0]
    assert [weight_version_number(name) for name in (None, "step", "v3", "step3b")] == [None] * 4


def test_token_versions_survive_resumes_and_checkpoints_and_become_lags():
    cut = versioned([3, 3])
    cut.turns[-1].extend(Turn([8], [-0.1], "", "stop", action_versions=[4]))  # resumed after a push
    cut.add_turn(Turn([9, 9], [-0.2, -0.2], "c", "stop"))  # an engine that did not name its weights
    cut.fill_versions(5)
    assert [t.action_versions for t in cut.turns] == [[3, 3, 4], [5, 5]] and cut.versions == [3, 3, 4, 5, 5]
    assert Trajectory.from_dict(json.loads(json.dumps(cut.to_dict()))).versions == cut.versions
    # A checkpoint written before versions were kept: its tokens get the version the loader gives.
    older = cut.to_dict()
    for turn in older["sequences"][0]["turns"]:
        del turn["action_versions"]
    assert Trajectory.from_dict(older, version=2).versions == [2] * 5
    assert Trajectory.from_dict(older).versions == []
    # Labels: the prompt's second token, then the five sampled ones; at version 5 the lags are 2, 2, 1, 0, 0.
    batch = training_batch([[cut, versioned([-1])]], version=5)
    assert batch.tokens["lags"].tolist() == [0, 2, 2, 1, 0, 0] + [0, 0]  # the unknown token counts as lag 0
    assert "lags" not in training_batch([[cut]]).tokens


def test_a_bound_on_staleness_drops_whole_groups_by_their_oldest_token():
    fresh, mixed, old = [versioned([4, 4])], [versioned([4]), versioned([2, 4])], [versioned([3])]
    unknown = [versioned([-1])]
    assert drop_stale_groups([fresh, mixed, old, unknown], version=4, max_staleness=1) == ([fresh, old, unknown], 1)
    assert drop_stale_groups([fresh, mixed, old], version=4, max_staleness=2) == ([fresh, mixed, old], 0)
    # 0 keeps only what the weights being trained sampled: everything carried from an earlier step goes.
    assert drop_stale_groups([mixed, old], version=4, max_staleness=0) == ([], 2)


def test_staleness_metrics_by_hand():
    # At version 4: tokens at lags 0, 0, 2, 0, 1, 1 and one of unknown version; spans 2 (versions 2-4) and 1.
    groups = [[versioned([4, 4], [2]), versioned([-1])], [versioned([4, 3, 3])]]
    metrics = staleness_metrics(groups, version=4, max_lag=3)
    assert metrics == {"staleness/lag_0": 3 / 6, "staleness/lag_1": 2 / 6, "staleness/lag_2": 1 / 6,
                       "staleness/lag_3": 0.0, "staleness/mean_lag": 4 / 6, "staleness/max_span": 2.0}
    synchronous = staleness_metrics([[versioned([4, 4])]], version=4)
    assert synchronous == {"staleness/lag_0": 1.0, "staleness/mean_lag": 0.0, "staleness/max_span": 0.0}


def roll_fresh(model, tok, env, prompt: str, params: dict, turns: int) -> Trajectory:
    engine = EmbeddedEngine(model, tok, max_running_requests=1)
    try:
        return asyncio.run(run_trajectory(EnvRollout(engine, env, tok, max_turns=3), prompt, {"turns": turns}, params))
    finally:
        engine.shutdown()


def test_partial_rollout_without_a_pause_returns_everything(engine, tok, prompt):
    env = load_env(ENVS / "echo.py")
    rows = [{"prompt": prompt, "extra_info": {"turns": 2}}] * 2
    finished, carried, newly = asyncio.run(partial_rollout_batch(EnvRollout(engine, env, tok, max_turns=2),
                                                                 [], rows, 5, 2, GREEDY))
    assert carried == [] and [len(g) for g in finished] == [2, 2] and newly == finished
    assert all(t.stop_reason == "done" and t.n_turns == 2 for g in finished for t in g)


def test_a_group_carried_finished_counts_for_the_batch_but_is_not_reported_again(engine, tok, prompt):
    """A group finished beyond one step's batch is carried into the next: it fills that batch, but
    only the groups the call itself finished (a cut one resumed, a new one) are newly finished."""
    env = load_env(ENVS / "echo.py")
    row = {"prompt": prompt, "extra_info": {"turns": 1}}
    [done], _, _ = asyncio.run(partial_rollout_batch(EnvRollout(engine, env, tok), [], [row], 1, 2, GREEDY))
    cut = []
    for _ in range(2):  # cut by a pause before its first action, as the stop flag leaves it
        trajectory = Trajectory(extra_info={"turns": 1}, state=prompt, env_info={"turns": 1}, stop_reason="abort")
        trajectory.start_sequence(prompt, encode(tok, prompt))
        trajectory.add_turn(Turn([], [], "", "abort"))
        cut.append(trajectory)
    finished, carried, newly = asyncio.run(partial_rollout_batch(EnvRollout(engine, env, tok),
                                                                 [done, cut], [row], 3, 2, GREEDY))
    assert carried == [] and len(finished) == 3 and all(t.stop_reason == "done" for g in finished for t in g)
    assert finished[0][0] is done[0] and [g[0] for g in newly] == [g[0] for g in finished[1:]]
    assert newly[0][0] is cut[0] and len(cut[0].turns[0].action_ids) == GREEDY["max_new_tokens"]


def test_an_unset_token_budget_is_the_models_context(tmp_path):
    """Past the context SGLang refuses a request (failing the rollout); as the budget, it ends one trajectory."""
    from transformers import LlamaConfig

    from RL2.engine import context_length

    LlamaConfig(max_position_embeddings=300).save_pretrained(tmp_path)
    assert context_length(str(tmp_path), {}) == 300
    assert context_length(str(tmp_path), {"context_length": 128, "tp_size": 1}) == 128


def test_a_pause_that_fails_leaves_the_engine_ready_for_the_next_rollout(model, tok, prompt):
    class PauseThenFail(EmbeddedEngine):
        """The real engine; its pause goes through, then raises, as a failed abort request would."""

        async def pause_generation(self, mode: str = "abort") -> None:
            await super().pause_generation(mode)
            raise EngineError("abort request failed")

    env = load_env(ENVS / "echo.py")
    rows = [{"prompt": prompt, "extra_info": {"turns": 1 if i == 0 else 3}} for i in range(3)]
    engine = PauseThenFail(model, tok, max_running_requests=1)
    try:
        with pytest.raises(EngineError, match="abort request failed"):
            asyncio.run(partial_rollout_batch(EnvRollout(engine, env, tok, max_turns=3), [], rows, 1, 1, GREEDY))

        async def next_rollout():  # would wait for ever on a paused engine
            return await asyncio.wait_for(rollout_batch(EnvRollout(engine, env, tok), rows[:1], 1, GREEDY), timeout=60)

        [[trajectory]] = asyncio.run(next_rollout())
        assert trajectory.stop_reason == "done"
    finally:
        engine.shutdown()


def test_a_rollout_cut_by_someone_elses_pause_carries_on(engine, model, tok, prompt):
    env = load_env(ENVS / "echo.py")
    params = {**GREEDY, "max_new_tokens": 6}
    cutting = CutOnce(model, tok, max_running_requests=4)
    try:
        [[cut]] = asyncio.run(rollout_batch(EnvRollout(cutting, env, tok, max_turns=2),
                                            [{"prompt": prompt, "extra_info": {"turns": 2}}], 1, params))
    finally:
        cutting.shutdown()
    assert cutting.calls == 3 and (cut.stop_reason, cut.n_turns) == ("done", 2)
    uncut = roll(engine, tok, "echo", prompt, {"turns": 2}, max_turns=2, sampling_params=params)
    [got], [want] = cut.token_sequences(), uncut.token_sequences()
    assert got["input_ids"] == want["input_ids"] and got["loss_mask"] == want["loss_mask"]

    refusing = CutOnce(model, tok, always=True)
    try:
        with pytest.raises(EngineError, match="aborted a request 3 times in a row before it sampled a token"):
            asyncio.run(rollout_batch(EnvRollout(refusing, env, tok), [{"prompt": prompt}], 1, params))
    finally:
        refusing.shutdown()


def test_a_checkpointed_trajectory_keeps_numpy_and_torch_values_of_its_row():
    """A Parquet row's numbers arrive as numpy values: a partial rollout's checkpoint (JSON) keeps them."""
    import numpy as np

    extra_info = {"answer": np.int64(5), "ids": np.array([1, 2]), "tags": {"b", "a"}, "score": torch.tensor(2.5),
                  "live": object()}
    saved = json.loads(json.dumps(Trajectory(extra_info=extra_info).to_dict()))
    assert Trajectory.from_dict(saved).extra_info == {"answer": 5, "ids": [1, 2], "tags": ["a", "b"], "score": 2.5,
                                                      "live": None}
