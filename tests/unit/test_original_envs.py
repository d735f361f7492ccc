"""The env scripts of the original RL2's releases run as `rollout.env_path` unchanged
(`tests/data/original_envs/`: countdown, orz and searchr1 of 0.0.1.post1 and 0.0.2, and gem of each),
through RL2's `Env` on a thread of its own as in a run; and RL2's own envs/orz.py and envs/searchr1.py
score as those did, searching a BM25 index of a corpus made here (`RL2.rewards.retrieval`)."""

import asyncio
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web

from RL2.config import ConfigError, parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.datasets.prompts import prompt_row_tokenizer
from RL2.datasets.splits import load_splits
from RL2.rewards.retrieval import BM25, search_app, search_r1_passages
from RL2.rollout.env import load_env
from tests.helpers import REPO, TESTS

ORIGINAL = TESTS / "data" / "original_envs"
CORPUS = [{"contents": "Norway\nThe capital of Norway is Oslo."},
          {"contents": "Peru\nThe capital of Peru is Lima."},
          {"contents": "Kenya\nNairobi is the capital of Kenya."}]


def on_a_thread(coroutine):
    """Run a coroutine as RL2 runs environment code: on an event loop in a thread that is not the main one."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=asyncio.run(coroutine)))
    thread.start()
    thread.join()
    return result["value"]


@pytest.mark.parametrize("action,reward,score", [
    ("<answer>(3 + 5) * 2</answer>", 1.0, 1.0),
    ("<answer>3 * 5 + 2</answer>", 0.1, 0.0),  # the original's format reward: an equation, the wrong value
    ("<answer>4 * 4</answer>", 0.1, 0.0),  # other numbers
    ("no answer", 0.0, 0.0),
])
def test_original_countdown_scores_as_it_did(action, reward, score):
    env = load_env(ORIGINAL / "countdown.py")
    result = on_a_thread(env.step("prompt", action, {"numbers": [2, 3, 5], "target": 16}))
    assert (result.reward, result.score, result.done) == (reward, score, True)


@pytest.mark.parametrize("script", [ORIGINAL / "orz.py", REPO / "envs" / "orz.py"], ids=["original", "rl2"])
def test_orz_verifies_math_off_the_main_thread(script):
    """math-verify's default timeouts use SIGALRM, which only the main thread may; environment code runs on
    a thread of its own, where the original's `verify(parse(answer), parse(action))` now runs too."""
    env = load_env(script)
    for action, reward in (("so $x = \\boxed{\\frac{1}{2}}$", 1.0), ("so x = 0.5", 1.0), ("so x = \\boxed{2}", 0.0)):
        assert on_a_thread(env.step("prompt", action, {"answer": "\\frac{1}{2}"})).reward == reward, action


PACKAGE_SCRIPT = """import math_verify


async def step(state, action, extra_info):
    right = math_verify.verify(math_verify.parse(extra_info["answer"]), math_verify.parse(action))
    return {"reward": float(right), "done": True}
"""


@pytest.mark.parametrize("script", ["original orz", "import math_verify"])
def test_loading_a_script_leaves_math_verify_as_other_code_sees_it(script, tmp_path):
    """Only the script's own names for math-verify's `parse` and `verify` run without timeouts off the main
    thread: math-verify itself, as any other code calls it, keeps its SIGALRM timeouts, which refuse to run
    in any other thread, and the script keeps them on the main thread."""
    math_verify = pytest.importorskip("math_verify", reason="math-verify is not installed (pip install math-verify)")
    from math_verify import grader, parser

    def seen() -> list:
        return [math_verify.parse, math_verify.verify, parser.parse, parser.timeout, grader.verify, grader.timeout]

    before = seen()
    if script == "import math_verify":
        (tmp_path / "package.py").write_text(PACKAGE_SCRIPT)
    env = load_env(ORIGINAL / "orz.py" if script == "original orz" else tmp_path / "package.py")
    assert all(now is then for now, then in zip(seen(), before, strict=True))
    with ThreadPoolExecutor(1) as other_thread, pytest.raises(ValueError, match="threaded environment"):
        other_thread.submit(math_verify.parse, "$\\frac{1}{2}$").result()
    for action, reward in (("so $x = \\boxed{\\frac{1}{2}}$", 1.0), ("so x = \\boxed{2}", 0.0)):
        info = {"answer": "$\\frac{1}{2}$"}
        assert on_a_thread(env.step("prompt", action, info)).reward == reward, action
        assert asyncio.run(env.step("prompt", action, info)).reward == reward, action  # the main thread


@pytest.mark.parametrize("release", ["0.0.1.post1", "0.0.2"])
def test_original_gem_pools_its_environments(release):
    """0.0.1.post1 picks its pooled GEM environment by `extra_info["idx"]` (the original numbered every
    row) and locks it until the trajectory is done; 0.0.2's `reset` returns `(state, extra_info)`."""
    env = load_env(ORIGINAL / f"gem_{release}.py")

    async def trajectory(info: dict):
        state = await env.reset(info)
        return state, await env.step(state, "\\boxed{1}", info)

    async def trajectories():
        infos = [{} for _ in range(20)]  # more trajectories than the 16 pooled environments, all at once
        return infos, *zip(*await asyncio.gather(*(trajectory(info) for info in infos)))

    infos, states, results = on_a_thread(trajectories())
    assert sorted(info["idx"] for info in infos) == list(range(20))  # a number of its own each
    if release == "0.0.2":
        assert all(0 <= info["env_idx"] < 16 for info in infos)  # the extra_info reset returned
    assert all(state.startswith("<|im_start|>user\nQuestion: ") for state in states)
    assert all(r.done and r.reward in (0.0, 1.0) for r in results)


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in CORPUS))
    return path


def test_bm25_ranks_the_passage_with_the_query_words_first(corpus_file):
    passages = [row["contents"] for row in CORPUS]
    assert BM25(passages).top("capital of Peru", k=1) == [passages[1]]
    assert search_r1_passages(str(corpus_file), "Nairobi Kenya", k=2).splitlines()[0] == (
        "Doc 1(Title: Kenya) Nairobi is the capital of Kenya.")


@pytest.fixture
def search_service(corpus_file):
    """`python -m RL2.rewards.retrieval` on port 10000, where the original's envs/searchr1.py asks."""
    with socket.socket() as probe:
        if probe.connect_ex(("localhost", 10000)) == 0:
            pytest.skip("port 10000, which the original's envs/searchr1.py asks, is taken on this machine")
    loop, started = asyncio.new_event_loop(), threading.Event()

    async def serve():
        runner = web.AppRunner(search_app(str(corpus_file), 3))
        await runner.setup()
        await web.TCPSite(runner, "localhost", 10000).start()
        started.set()
        return runner

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(serve(), loop).result(timeout=30)
    yield "http://localhost:10000/search"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def searchr1_turns(env) -> list:
    info = {"answer": ["Oslo", "Christiania"]}

    async def turns():
        searched = await env.step("Q: capital of Norway?", "<search> capital of Norway </search>", info)
        answered = await env.step(searched.next_state, "<answer> oslo. </answer>", info)
        wrong = await env.step(searched.next_state, "<answer>Lima</answer>", info)
        invalid = await env.step("Q", "I think", info)
        return searched, answered, wrong, invalid

    return on_a_thread(turns())


@pytest.mark.parametrize("script", ["original", "rl2 over http", "rl2 in process"])
def test_searchr1_searches_then_answers(script, search_service, corpus_file, monkeypatch):
    if script == "rl2 in process":
        monkeypatch.setenv("RL2_SEARCH_CORPUS", str(corpus_file))
    env = load_env(ORIGINAL / "searchr1.py" if script == "original" else REPO / "envs" / "searchr1.py")
    searched, answered, wrong, invalid = searchr1_turns(env)
    # The search result extends state + action: the rollout continues one sequence.
    assert searched.next_state.startswith("Q: capital of Norway?<search> capital of Norway </search>\n\n<information>")
    assert "Doc 1(Title: Norway) The capital of Norway is Oslo." in searched.next_state
    assert (searched.done, answered.done, answered.reward, wrong.reward) == (False, True, 1.0, 0.0)
    assert not invalid.done and "My previous action is invalid" in invalid.next_state


def test_an_environment_that_resets_trains_without_data(tok):
    """The original's gem lines give no data: each step rolls out prompts_per_rollout rows of nothing, whose
    prompts the env's reset makes (its BaseDataset: `[{} for _ in range(config.prompts_per_rollout)]`)."""
    data = parse_config(PPOConfig, "ppo", ["train_data.prompts_per_rollout=3", "test_data.prompts_per_rollout=2"]).data
    blank = {"train": ("data.train.batch_size", 3), "test": ("rollout.test_prompts_per_rollout", 2)}
    train, test = load_splits(data, prompt_row_tokenizer(tok, env_resets=True), 0, blank)
    assert [row["prompt"] for row in train] == [None] * 3 and [row["prompt"] for row in test] == [None] * 2
    with pytest.raises(ConfigError, match="data.train.path is not set"):  # an env without reset needs its data
        load_splits(data, prompt_row_tokenizer(tok), 0, None)


def test_the_embedded_engine_says_it_runs_without_server_args(tiny_model_path, tok, capsys):
    """The original's lines set SGLang flags (`rollout.server_args.tp_size=4`, `rollout.tp_size`); the
    embedded engine has no use for them, and says so rather than dropping them without a word."""
    import torch
    from omegaconf import OmegaConf

    from RL2.engine import start_engine

    rollout = OmegaConf.create({"engine": "embedded", "server_url": None, "max_running_requests": 2,
                                "server_args": {"tp_size": 4, "mem_fraction_static": 0.6}})
    engine = start_engine(rollout, tiny_model_path, torch.float32, torch.device("cpu"), tok)
    engine.shutdown()
    assert ("rollout.server_args {'tp_size': 4, 'mem_fraction_static': 0.6} are flags of SGLang servers; the "
            "embedded engine runs without them") in capsys.readouterr().out
