"""The default model's converted folder: written atomically by one process at a time, recovered
from a half-written earlier conversion and from the leftovers of a killed one.

A stand-in conversion (a few small files, written slowly) replaces dequantizing the 98 MB GGUF,
except in the last two tests, which use the real model.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from RL2.models.default_model import ensure_converted, is_complete, resolve_model_path
from tests.helpers import REPO

# Logs "start", then converts with a stand-in that logs "convert" and writes a small but complete
# model folder once `wait_for` processes have logged "start" (or after `pause` seconds), so that they
# all reach the conversion while it is under way.
STAND_IN = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from RL2.models.default_model import ensure_converted

    target, log, pause, wait_for = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])

    def record(event):
        with open(log, "a") as f:
            f.write(f"{event} {os.getpid()}\\n")

    def convert(folder):
        record("convert")
        (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
        deadline = time.time() + pause
        while log.read_text().count("start") < wait_for and time.time() < deadline:
            time.sleep(0.05)
        save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(folder / "model.safetensors"))
        (folder / "tokenizer_config.json").write_text("{}")
        record("converted")

    record("start")
    print(ensure_converted(target, convert), flush=True)
""")


def events(log: Path) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()]


def start_stand_in(target: Path, log: Path, pause: float, wait_for: int = 1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", STAND_IN, str(target), str(log), str(pause), str(wait_for)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)


def write_model(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(folder / "model.safetensors"))
    (folder / "tokenizer_config.json").write_text("{}")


def counting(calls: list):
    def convert(folder: Path) -> None:
        calls.append(folder)
        write_model(folder)

    return convert


def test_completeness_is_judged_by_every_file(tmp_path):
    write_model(tmp_path / "m")
    assert is_complete(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1])  # one byte short of the last tensor's end
    assert not is_complete(tmp_path / "m")
    weights.write_bytes(data)
    (tmp_path / "m" / "config.json").write_text('{"model_type": ')  # cut mid-write
    assert not is_complete(tmp_path / "m")
    write_model(tmp_path / "n")
    (tmp_path / "n" / "tokenizer_config.json").unlink()
    assert not is_complete(tmp_path / "n")


@pytest.mark.parametrize("leftover", ["no config", "config but truncated weights", "empty folder"])
def test_half_written_folder_is_converted_again(tmp_path, leftover):
    """The old failure: the rename onto a non-empty folder raised "Directory not empty" at every start."""
    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    if leftover == "no config":
        save_file({"w": torch.zeros(10)}, str(target / "model.safetensors"))
    elif leftover == "config but truncated weights":
        (target / "config.json").write_text("{}")
        save_file({"w": torch.zeros(1000)}, str(target / "model.safetensors"))
        data = (target / "model.safetensors").read_bytes()
        (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    calls = []
    assert ensure_converted(target, counting(calls)) == target
    assert len(calls) == 1 and is_complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]  # nothing left beside it
    assert ensure_converted(target, counting(calls)) == target and len(calls) == 1  # done once


def test_leftovers_of_killed_conversions_do_not_block(tmp_path):
    target, log = tmp_path / "models" / "m", tmp_path / "log"
    killed = start_stand_in(target, log, pause=60, wait_for=2)  # waits for a second start that never comes
    while not log.exists() or "convert" not in events(log):  # it holds the lock and is converting
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    (target.parent / "m.tmp12345").mkdir()  # a leftover of RL2's earlier temporary-folder naming
    leftovers = sorted(p.name for p in target.parent.iterdir() if p.name != ".m.lock")
    assert len(leftovers) == 2 and leftovers[0].startswith(".m.tmp-") and not target.exists()
    calls = []
    assert ensure_converted(target, counting(calls)) == target and len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]


def test_processes_starting_at_once_convert_once(tmp_path):
    target, log = tmp_path / "models" / "m", tmp_path / "log"
    processes = [start_stand_in(target, log, pause=60, wait_for=3) for _ in range(3)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0]
    assert outputs == [str(target)] * 3
    # All three started before the conversion finished; one converted, the others waited and found it done.
    assert sorted(events(log)[:4]) == ["convert", "start", "start", "start"]
    assert events(log).count("convert") == 1 and events(log)[-1] == "converted"
    assert is_complete(target)
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]


def test_failed_conversion_leaves_nothing_and_raises(tmp_path):
    target = tmp_path / "models" / "m"

    def broken(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ensure_converted(target, broken)

    def incomplete(folder: Path) -> None:
        (folder / "config.json").write_text("{}")

    with pytest.raises(RuntimeError, match="incomplete model folder"):
        ensure_converted(target, incomplete)
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock"]


def test_embedded_model_resolves_to_a_complete_folder():
    path = Path(resolve_model_path("smollm2-135m-instruct"))
    assert is_complete(path)
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(path).model_type == "llama"
    assert AutoTokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


@pytest.mark.slow
def test_real_conversion_recovers_from_a_half_written_folder(tmp_path, monkeypatch):
    """The real GGUF, converted into a fresh cache over a half-written folder, gives the same
    weights as the GGUF loaded by transformers itself."""
    from transformers import AutoModelForCausalLM

    from RL2.models.default_model import _gguf_file

    monkeypatch.setenv("RL2_CACHE", str(tmp_path))
    target = tmp_path / "models" / "smollm2-135m-instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a folder an interrupted earlier conversion left
    path = resolve_model_path("smollm2-135m-instruct")
    assert path == str(target) and is_complete(target)
    gguf = _gguf_file("smollm2-135m-instruct")
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).state_dict()
    converted = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert converted.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(converted[key], value, rtol=0, atol=0)
    assert sorted(os.listdir(tmp_path / "models")) == [".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]
