"""The default model's converted folder: written atomically by one process at a time, recovered
from a half-written earlier conversion and from the leftovers of a killed one.

A stand-in conversion (a few small files, written slowly) replaces dequantizing the 98 MB GGUF,
except in the tests that use the real model. Its weights are bfloat16 values: dequantized 4-bit
blocks put 8% of them halfway between two, where any update, however small, moves a weight a whole
bf16 step in bf16 compute.
"""

import copy
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

from RL2.models.default_model import (
    CONVERSION_FORMAT,
    CONVERSION_MARKER,
    conversion_format,
    ensure_converted,
    is_complete,
    resolve_model_path,
)
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


def test_a_folder_converted_in_another_format_is_converted_again(tmp_path):
    """A cache converted before the weights were rounded to bf16 values has no marker (format 1)."""
    target = tmp_path / "models" / "m"
    write_model(target)  # complete, but of the earlier format
    calls = []
    assert ensure_converted(target, counting(calls), version=2) == target and len(calls) == 1
    assert conversion_format(target) == 2
    assert ensure_converted(target, counting(calls), version=2) == target and len(calls) == 1  # now current
    (target / CONVERSION_MARKER).write_text(json.dumps({"format": 1}))
    assert ensure_converted(target, counting(calls), version=2) == target and len(calls) == 2
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]


def bf16_low_bits(weights: torch.Tensor) -> torch.Tensor:
    """The 16 bits of each float32 that bfloat16 drops: 0 on a bf16 value, 0x8000 halfway between two
    (little-endian: the first half of each float32)."""
    return weights.reshape(-1).view(torch.int16)[0::2].to(torch.int32) & 0xFFFF


def test_default_model_weights_are_bfloat16_values():
    from safetensors import safe_open

    path = Path(resolve_model_path("smollm2-135m-instruct"))
    assert conversion_format(path) == CONVERSION_FORMAT
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        count = 0
        for key in f.keys():
            weights = f.get_tensor(key)
            assert weights.dtype == torch.float32, key  # what config.json says; bf16 values are exact in it
            off_bf16 = torch.count_nonzero(bf16_low_bits(weights))  # midpoints (0x8000) among them
            assert off_bf16 == 0, f"{key}: {off_bf16} weights are not bf16 values"
            count += weights.numel()
    assert count > 134e6


def two_adam_steps_change(modules: list[torch.nn.Module], loss_fn, outputs_fn) -> dict[torch.dtype, float]:
    """Mean absolute change of `outputs_fn()` in float32 and bfloat16 after two AdamW steps at lr 1e-6
    on `loss_fn()`, the way RL2 trains: float32 master weights, cast to the compute dtype."""
    def outputs(dtype):
        copies = [copy.deepcopy(m).to(dtype) for m in modules]
        with torch.no_grad():
            return outputs_fn(copies, dtype).float()

    before = {dtype: outputs(dtype) for dtype in (torch.float32, torch.bfloat16)}
    parameters = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=1e-6, weight_decay=0.0)
    for _ in range(2):
        loss_fn(modules).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {dtype: (outputs(dtype) - value).abs().mean().item() for dtype, value in before.items()}


def mlp_change(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> dict[torch.dtype, float]:
    """`two_adam_steps_change` of one Llama MLP with these weights, fitting random targets."""
    def linear(weights):
        layer = torch.nn.Linear(weights.shape[1], weights.shape[0], bias=False)
        layer.weight.data.copy_(weights)
        return layer

    torch.manual_seed(0)
    x, target = torch.randn(64, gate.shape[1]), torch.randn(64, down.shape[0])

    def forward(modules, dtype=torch.float32):
        gate, up, down = modules
        h = x.to(dtype)
        return down(torch.nn.functional.silu(gate(h)) * up(h))

    mlp = [linear(gate), linear(up), linear(down)]
    return two_adam_steps_change(mlp, lambda ms: ((forward(ms) - target) ** 2).mean(), forward)


def test_two_small_steps_on_an_mlp_change_bf16_outputs_no_more_than_float32():
    """The check of the next test on one MLP of the default model (milliseconds instead of a minute)."""
    from safetensors import safe_open

    path = Path(resolve_model_path("smollm2-135m-instruct"))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        mlp = [f.get_tensor(f"model.layers.3.mlp.{name}_proj.weight") for name in ("gate", "up", "down")]
    change = mlp_change(*mlp)
    assert 0 < change[torch.bfloat16] <= change[torch.float32]


@pytest.mark.slow
def test_two_small_steps_on_the_dequantized_mlp_change_bf16_outputs_more():
    """The same MLP as dequantized from the GGUF (the weights converted before): its bf16 outputs change
    several times more than its float32 ones, which the check above must see."""
    from gguf import GGUFReader, dequantize

    from RL2.models.default_model import _gguf_file

    reader = GGUFReader(_gguf_file("smollm2-135m-instruct"))  # ~5 s: it parses every tensor's header
    tensors = {t.name: t for t in reader.tensors}
    blocks = [tensors[f"blk.3.ffn_{name}.weight"] for name in ("gate", "up", "down")]
    mlp = [torch.from_numpy(dequantize(t.data, t.tensor_type).copy()) for t in blocks]  # as transformers loads them
    assert sum((bf16_low_bits(w) == 0x8000).sum().item() for w in mlp) > 0.05 * sum(w.numel() for w in mlp)
    change = mlp_change(*mlp)
    assert change[torch.bfloat16] > 3 * change[torch.float32]
    change = mlp_change(*[w.to(torch.bfloat16).float() for w in mlp])  # what the conversion now stores
    assert change[torch.bfloat16] <= change[torch.float32]


@pytest.mark.slow
def test_two_small_steps_change_the_default_models_bf16_outputs_no_more_than_float32():
    """Two AdamW steps at lr 1e-6 on one answer: the log-probabilities of the whole model change no
    more in bf16 than in float32 (as dequantized, bf16 changed ~6x more)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 + 5? Reply with the number only."}],
                                           add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt + "12", return_tensors="pt").input_ids

    def logps(modules, dtype=None):
        return torch.log_softmax(modules[0](ids).logits[0, :-1].float(), -1)

    def loss(modules):
        return -logps(modules).gather(-1, ids[0, 1:, None]).mean()

    change = two_adam_steps_change([model], loss, logps)
    assert 0 < change[torch.bfloat16] <= change[torch.float32]


@pytest.mark.slow
def test_real_conversion_recovers_from_a_half_written_folder(tmp_path, monkeypatch):
    """The real GGUF, converted into a fresh cache over a half-written folder, gives the weights of
    the GGUF loaded by transformers itself, rounded to bfloat16 values."""
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
        torch.testing.assert_close(converted[key], value.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert sorted(os.listdir(tmp_path / "models")) == [".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]
