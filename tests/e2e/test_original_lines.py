"""Example lines of the original RL2 (`tests/data/original_example_lines.txt`) through a real training run,
as their authors wrote them but for what a test machine cannot have: the hub datasets are local files made
here (`LOCAL_DATA`), every model is the tiny one, the env scripts are the original's own of the releases
(`tests/data/original_envs/`), and sizes are cut to a step of a few short samples (`SMALL`, set where
the line sets them, under whatever name it uses). The 0.0.2 countdown line runs in the default suite;
the others are slow (`-m slow`)."""

import json
import re
import socket
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from RL2.compat.aliases import resolve
from RL2.compat.keys import Ignored
from RL2.config.cli import schema_keys
from tests.helpers import REPO, TESTS
from tests.helpers.launch import read_metrics, run_ranks
from tests.unit.test_original_lines import LINES, SCHEMAS, OriginalLine, line_of, start

ORIGINAL_ENVS = TESTS / "data" / "original_envs"
SMALL = {"data.train.batch_size": 2, "rollout.responses_per_prompt": 2, "trainer.total_steps": 1,
         "rollout.train_sampling_params.max_new_tokens": 8, "rollout.test_sampling_params.max_new_tokens": 8,
         "data.train.max_length": 256, "data.test.max_length": 256, "actor.max_length_per_device": 512,
         "critic.max_length_per_device": 512, "rollout.test_prompts_per_rollout": 2}
SEARCH_CORPUS = [{"contents": "Norway\nThe capital of Norway is Oslo."}, {"contents": "Peru\nLima is in Peru."}]


def countdown(k: int) -> dict:
    return {"prompt": f"Using the numbers [{k}, 2, 3], create an equation that equals {k + 5}. Answer in "
                      f"<answer></answer>.", "extra_info": {"numbers": [k, 2, 3], "target": k + 5}}


def math_row(k: int) -> dict:
    return {"prompt": f"What is {k} + 1? Put it in \\boxed{{}}.", "extra_info": {"answer": str(k + 1)}}


def search_row(k: int) -> dict:
    return {"prompt": "Answer with <search>query</search> and <answer>answer</answer>. What is the capital of "
                      f"Norway? ({k})", "extra_info": {"answer": ["Oslo"]}}


def pair_row(k: int) -> dict:
    return {"prompt": f"Say {k}.", "chosen": f"{k}", "rejected": f"not {k}"}


LOCAL_DATA = {  # the hub datasets of the lines: rows of the same form, a few per split
    "Chenmien/Countdown": countdown, "Chenmien/OpenReasonerZero": math_row, "Chenmien/OlympiadBench": math_row,
    "Chenmien/SearchR1": search_row, "Chenmien/EmptyDataset": lambda k: {"extra_info": {}},
    "Chenmien/LIMO": lambda k: {"messages": [{"role": "user", "content": f"Count to {k}."},
                                             {"role": "assistant", "content": " ".join(map(str, range(k + 1)))}]},
    "Chenmien/UltraFeedback": pair_row, "Chenmien/SkyworkRM": pair_row,
}
HUB_PATH = re.compile(r"^(?:(\w+)@)?(Chenmien/\w+)$")


def local_file(value: str, folder) -> str:
    """A local file of rows for `[split@]Chenmien/Name`; any other value as it is."""
    match = HUB_PATH.match(value)
    if not match:
        return value
    split, name = match.group(1) or "train", match.group(2)
    path = folder / f"{name.split('/')[1]}_{split}.jsonl"
    path.write_text("".join(json.dumps(LOCAL_DATA[name](k)) + "\n" for k in range(4)))
    return str(path)


def env_script(value: str, line: OriginalLine) -> str:
    """The original's own script of the releases for `envs/<name>.py` (gem: 0.0.1.post1's before 0.0.2)."""
    name = value.removeprefix("envs/").removesuffix(".py")
    if name == "gem":
        name = "gem_0.0.1.post1" if line.source.split()[1] < "2025-09-25" else "gem_0.0.2"
    return str(ORIGINAL_ENVS / f"{name}.py")


def runnable(line: OriginalLine, model: str, folder) -> list[str]:
    """The line's arguments with local data, the tiny model, the original's env scripts and `SMALL` sizes."""
    keys, cfg, args, set_here = schema_keys(SCHEMAS[line.trainer]), start(line), [], set()
    small = SMALL | ({"trainer.total_steps": cfg.actor.freeze_steps + 1} if "actor" in cfg and (
        cfg.get("adv") and cfg.actor.freeze_steps) else {})
    for arg in line.args:
        key, _, value = arg.partition("=")
        found = resolve(key.lstrip("+"), keys)
        current = found[0] if isinstance(found, tuple) else (key.lstrip("+"),)
        set_here.update(current)
        if current[0] in small:
            value = str(small[current[0]])
        elif current[0].endswith(".model_name"):
            value = model
        elif current[0] == "rollout.env_path":
            value = env_script(value, line)
        args.append(f"{key}={local_file(value, folder)}")
    absent = object()
    missing = [f"{k}={v}" for k, v in small.items() if k not in set_here and OmegaConf.select(cfg, k, default=absent)
               is not absent]
    return args + missing + [f"trainer.save_dir={folder / 'run'}"]


def ranks(line: OriginalLine) -> int:
    cfg = start(line)
    return max(cfg[model].cp_size for model in ("actor", "critic") if model in cfg)


def run_line(line: OriginalLine, model: str, tmp_path) -> list[dict]:
    folder = tmp_path / "data"
    folder.mkdir()
    args = runnable(line, model, folder)
    result = run_ranks(ranks(line), ["-m", f"RL2.trainer.{line.trainer}", *args], timeout=600)
    for arg in line.args:  # each original key said what it is now, or that it is ignored
        key = arg.split("=")[0].lstrip("+")
        found = resolve(key, schema_keys(SCHEMAS[line.trainer]))
        if isinstance(found, Ignored) or isinstance(found, tuple) and found[0] != (key,):
            assert f"config key '{key}" in result.stdout, key
    return read_metrics(tmp_path / "data" / "run")


def assert_trained(metrics: list[dict], trainer: str, steps: int = 1):
    trained = [m for m in metrics if m["step"] >= 1 and any(k.startswith(("actor/", "critic/", "train/")) for k in m)]
    assert [m["step"] for m in trained] == list(range(1, steps + 1)), metrics
    if trainer == "ppo":  # every trajectory went through the env script without a fault
        assert all("rollout/reward" in m and m["rollout/faults"] == 0 for m in trained), trained


def test_countdown_of_the_releases_trains_a_step(tiny_model_path, tmp_path):
    line = line_of("countdown_reinforce", "0.0.2")
    metrics = run_line(line, tiny_model_path, tmp_path)
    assert_trained(metrics, "ppo")
    # test_freq=8 of a one-step run: the split is tested before training and at the end
    assert [m["step"] for m in metrics if "test/response_length" in m] == [0, 1]


@pytest.fixture
def search_service(tmp_path):
    """The original's search service protocol (`python -m RL2.rewards.retrieval`) on port 10000, where
    the original's envs/searchr1.py asks."""
    with socket.socket() as probe:
        if probe.connect_ex(("localhost", 10000)) == 0:
            pytest.skip("port 10000, which the original's envs/searchr1.py asks, is taken on this machine")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(row) + "\n" for row in SEARCH_CORPUS))
    server = subprocess.Popen([sys.executable, "-m", "RL2.rewards.retrieval", str(corpus)], cwd=REPO)
    for _ in range(300):
        with socket.socket() as probe:
            if probe.connect_ex(("localhost", 10000)) == 0:
                break
        time.sleep(0.1)
    yield
    server.terminate()
    server.wait(timeout=30)


SLOW = [("gem_reinforce", "0.0.1.post1"), ("gem_reinforce", "0.0.2"), ("orz_reinforce", "0.0.2"),
        ("orz_ppo", "0.0.2"), ("searchr1", "0.0.2"), ("countdown_reinforce", "January 2026 main"),
        ("orz_ppo", "January 2026 main"), ("limo_sft", "0.0.2"), ("ultrafeedback_dpo", "0.0.2"),
        ("skywork_rm", "0.0.2"), ("limo_sft", "January 2026 main"), ("ultrafeedback_dpo", "January 2026 main"),
        ("skywork_rm", "January 2026 main")]


@pytest.mark.slow
@pytest.mark.parametrize("script,release", SLOW, ids=[f"{s}@{r.split()[0]}" for s, r in SLOW])
def test_original_line_trains(script, release, tiny_model_path, tmp_path, request):
    line = line_of(script, release)
    if script == "searchr1":
        request.getfixturevalue("search_service")
    metrics = run_line(line, tiny_model_path, tmp_path)
    cfg = start(line)
    frozen = cfg.actor.freeze_steps if line.trainer == "ppo" else 0
    assert_trained(metrics, line.trainer, steps=frozen + 1)
    if frozen:  # PPO's critic warm-up: the actor waits, the critic learns
        assert [m["actor/frozen"] for m in metrics if "actor/frozen" in m] == [1.0] * frozen + [0.0]
        assert all("critic/loss" in m for m in metrics if m["step"] >= 1)
    if script == "searchr1":  # multi-turn: an action without its tags gets the reminder and a second turn
        assert all(m["rollout/n_turns"] > 1 for m in metrics if "rollout/n_turns" in m)


def test_every_line_of_the_e2e_set_is_in_the_history():
    assert all(line_of(script, release) in LINES for script, release in SLOW)
