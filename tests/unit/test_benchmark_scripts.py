"""The benchmark scripts' own checks and arithmetic: what they refuse before running, and how their
tables' figures are computed."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.sglang import needs_sglang

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def benchmark_module(name: str):
    """A module of benchmarks/ (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(BENCHMARKS / name), *flags], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_w1_refuses_a_single_step_before_running():
    """bench_ppo_w1's tables are medians of the steps after the first: `--steps 1` used to run the whole
    workload and then end in `StatisticsError: no median for empty data`."""
    result = run_script("bench_ppo_w1.py", "--steps", "1", "--skip-trl")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--steps 1: give at least 2" in result.stderr


@pytest.mark.slow
@needs_sglang
def test_sglang_cpu_measures_the_embedded_engine_in_the_same_run():
    """bench_sglang_cpu printed SGLang's tokens/s alone, its baseline being a figure of another run; now a
    row of the embedded engine on the same requests, and the ratio of the two rows' medians."""
    result = run_script("bench_sglang_cpu.py", "--repeats", "1", "--requests", "2", "--new-tokens", "4",
                        "--threads", "1", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {cells[0]: float(cells[2]) for line in result.stdout.splitlines() if line.startswith("| ")
            and (cells := [c.strip() for c in line.strip("|").split("|")])[2].replace(".", "").isdigit()}
    sglang = next(rate for name, rate in rows.items() if name.startswith("SGLang"))
    embedded = next(rate for name, rate in rows.items() if name.startswith("embedded engine"))
    assert embedded > 0
    ratio = float(re.search(r"SGLang / embedded engine: ([0-9.]+)x", result.stdout).group(1))
    # the rows are rounded to whole tokens/s, the ratio is not
    assert abs(ratio - sglang / embedded) <= 0.01 + (0.5 / embedded) * (1 + sglang / embedded)


@pytest.mark.parametrize("flags, named", [
    (["--models", "7b"], "--models 7b: unknown ['7b']"),
    (["--models", "135m", "--rollouts", "8x4"], "--rollouts 8x4: ['8x4'] not PROMPTSxRESPONSESxTOKENS"),
    (["--models", "135m", "--rollouts", "1x1x1", "--ranks", "0"], "--ranks 0: ['0'] not a positive number"),
])
def test_ppo_memory_checks_its_grid_before_the_first_run(flags, named):
    """bench_ppo_memory's grid: an unknown model or a malformed rollout or rank count used to end in a
    KeyError or ValueError traceback where it came in the grid, after the runs before it."""
    result = run_script("bench_ppo_memory.py", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert named in result.stderr


def test_ppo_memory_prints_a_failed_run_and_then_fails(monkeypatch, capsys):
    """A trainer run that failed printed `exit code 1` in its row and the script exited 0, so a broken trainer
    read as a run killed for memory. A run not started because it cannot fit is a figure, not a failure."""
    bench = benchmark_module("bench_ppo_memory")
    monkeypatch.setattr(bench, "n_parameters", lambda config: 1)
    monkeypatch.setattr(bench, "model_config", lambda name: None)
    monkeypatch.setattr(bench, "run", lambda *args: {"failed": "exit code 1"})
    monkeypatch.setattr(sys, "argv", ["bench_ppo_memory.py", "--models", "135m", "--rollouts", "1x1x1", "--ranks", "1"])
    with pytest.raises(SystemExit, match=re.escape("failed: 135m 1x1x1 on 1 ranks (exit code 1)")):
        bench.main()
    assert "| 135m | 1x1x1 | 1 | | | | exit code 1 | no | no | |" in capsys.readouterr().out
    monkeypatch.setattr(bench, "machine_memory_gb", lambda: 0.0)
    bench.main()
    assert "| 135m | 1x1x1 | 1 | | | | needs at least 0 GB" in capsys.readouterr().out


def test_gpu_bench_prints_a_failed_system_and_then_fails(monkeypatch, capsys):
    """bench_gpu printed a failed worker's error in its row and exited 0: a broken PPO update went unseen."""
    bench = benchmark_module("bench_gpu")
    figures = {"step_s": 1.0, "tokens_per_s": 1.0, "flops_per_s": 1.0, "peak_gb": 0.0, "steps": 1}
    monkeypatch.setattr(bench, "make_model", lambda size, folder: 0)
    monkeypatch.setattr(bench, "run_worker", lambda system, workload, *_: "failed: AttributeError: no 'get'" if (
        system, workload) == ("rl2", "ppo") else figures)
    monkeypatch.setattr(sys, "argv", ["bench_gpu.py", "--device", "cpu"])
    with pytest.raises(SystemExit, match=r"^failed: ppo RL2 \(the worker's last line is in its row\)$"):
        bench.main()
    out = capsys.readouterr().out
    assert re.search(r"^ppo      RL2         failed: AttributeError: no 'get'$", out, re.MULTILINE), out
    assert re.search(r"^ppo      HF Trainer     1.000", out, re.MULTILINE), out  # the table is printed whole


@pytest.mark.slow
def test_sft_runs_the_dtype_asked_for_and_counts_its_flops():
    """bench_sft --dtype float32 also ran the bf16 rows (main ignored the flag). The GFLOP/s column
    against the step's FLOPs counted from the model's own parameters: 6 per parameter and token (the
    tied embedding once, as the LM head) plus causal attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from RL2.models.default_model import resolve_model_path

    seqs, seq_len = 2, 64
    result = run_script("bench_sft.py", "--dtype", "float32", "--steps", "1", "--seqs", str(seqs),
                        "--seq-len", str(seq_len), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["float32"], ["bfloat16"])]
    assert [row[:2] for row in rows] == [["float32", "1"], ["float32", "2"]], result.stdout
    config = AutoConfig.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    attention = config.num_hidden_layers * seqs * 2 * seq_len**2 * config.hidden_size  # QK^T and AV, half
    flops = 6 * n_params * seqs * seq_len + 3 * attention
    for _, _, step_s, _, gflops, *_ in rows:
        assert float(gflops) == pytest.approx(flops / float(step_s) / 1e9, rel=0.02, abs=0.06)


@pytest.mark.skipif(importlib.util.find_spec("trl") is not None, reason="TRL is installed here")
def test_w1_without_trl_says_so_before_running():
    """Without TRL, bench_ppo_w1 (which compares with it unless --skip-trl) ran RL2's workload and then
    ended in a traceback from TRL's worker, the RL2 figures unprinted."""
    result = run_script("bench_ppo_w1.py", "--steps", "2", timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "TRL is not installed: `pip install trl` to compare with it, or pass --skip-trl" in result.stderr


def test_w1_refuses_an_unknown_trl_mode():
    """A misspelt TRL mode ran TRL without gradient checkpointing under the misspelt name."""
    result = run_script("bench_ppo_w1.py", "--skip-trl", "--trl-modes", "checkpointing,no_checkpointing")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--trl-modes checkpointing,no_checkpointing: unknown ['no_checkpointing']" in result.stderr


def test_a_failing_worker_shows_its_error(tmp_path, capfd):
    """common.run_worker (bench_lora, bench_parallel_memory, bench_sft) captured the ranks' standard error
    and raised CalledProcessError, so a worker's own error never showed."""
    common = benchmark_module("common")
    script = tmp_path / "failing.py"
    script.write_text("import sys\nsys.exit('the worker could not start: no such dtype')\n")
    with pytest.raises(SystemExit, match="failing.py --worker --flag on 1 ranks failed"):
        common.run_worker(str(script), 1, ["--flag"])
    assert "the worker could not start: no such dtype" in capfd.readouterr().err


@pytest.mark.parametrize("script", ["bench_lora.py", "bench_engine.py", "bench_ppo_w1.py"])
def test_an_unknown_dtype_is_refused_naming_the_choices(script):
    """`--dtype` took any string: a typo ended in a KeyError from compute_dtype (in bench_lora, inside a
    torchrun worker, after the launch)."""
    result = run_script(script, "--dtype", "fp8")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "argument --dtype: invalid choice: 'fp8' (choose from 'auto'" in result.stderr


@pytest.mark.slow
def test_lora_memory_table_counts_mib_of_the_models_own_parameters():
    """bench_lora's memory columns divide bytes by 2**20 but were headed MB (the same in bench_sft,
    bench_parallel_memory, bench_fused_layers, and GB for 2**30 in bench_logps): checked here against
    the parameters of the model itself and LoRA's count, rank x (in + out) per adapted projection."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from RL2.models.default_model import resolve_model_path

    result = run_script("bench_lora.py", "--rank", "4", "--seq-len", "8", "--seqs", "1", "--steps", "1", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header[4:9] == ["params MiB", "grads MiB", "AdamW state MiB", "params + grads + AdamW MiB", "peak RSS MiB"]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]
    rows = {(row[0], row[1]): row for row in cells}
    config = AutoConfig.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    full = rows["full fine-tuning", "1"]
    assert float(full[3].removesuffix(" M")) == pytest.approx(n_params / 1e6, abs=0.005)
    assert float(full[4]) == pytest.approx(4 * n_params / 2**20, abs=0.5)  # float32 master weights
    assert float(full[5]) == pytest.approx(4 * n_params / 2**20, abs=0.05)
    assert float(full[6]) == pytest.approx(8 * n_params / 2**20, abs=0.05)  # AdamW's two moments
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * h // config.num_attention_heads
    per_layer = 4 * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))  # q, k and v, o, gate and up, down
    lora = rows["LoRA r=4", "1"]
    assert float(lora[3].removesuffix(" M")) == pytest.approx(config.num_hidden_layers * per_layer / 1e6, abs=0.005)


@pytest.mark.slow  # a minute of rollouts: in .ci/run's benchmark step
def test_agent_endpoint_bench_samples_the_same_tokens_both_ways():
    """bench_agent_endpoint times agents through each API of the endpoint (chat, streamed chat, responses, Anthropic's
    messages) against direct engine calls with the same seeds: all must sample the same tokens, or its overhead
    figures compare different work."""
    result = run_script("bench_agent_endpoint.py", "--tiny", "--prompts", "2", "--samples", "2", "--new-tokens", "3",
                        "--repeats", "1", timeout=300)  # five rollouts, each twice: a minute on a busy machine
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (direct engine\.generate|endpoint, [a-z ]+) \|.* \| 4/4 \| \d+ \|$", result.stdout, re.M)
    assert rows == ["direct engine.generate", "endpoint, chat", "endpoint, chat stream", "endpoint, responses",
                    "endpoint, messages"], result.stdout
    refused = run_script("bench_agent_endpoint.py", "--tiny", "--repeats", "0")
    assert refused.returncode == 2 and "--repeats 0: give at least 1" in refused.stderr


@pytest.mark.parametrize("flags, named", [
    (["--steps", "1"], "--steps 1: give at least 2"),
    (["--etas", "1,x"], "--etas 1,x: give comma-separated whole numbers"),
    (["--etas", "-1"], "--etas -1: a staleness bound is at least 0"),
])
def test_async_bench_checks_its_flags_before_the_first_run(flags, named):
    result = run_script("bench_async.py", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    assert named in result.stderr


def test_async_bench_workload_has_a_long_tail_and_scores_each_answer():
    """bench_async's long-tail workload: one prompt in `long_every` asks several questions in one
    conversation; each right answer is worth 1 / (its prompt's questions), a wrong number in the tags a
    tenth of that, and the next question follows the answer as a user turn."""
    import asyncio

    from RL2.rollout.env import load_env

    rows = benchmark_module("bench_async").rows(8, long_every=4, long_questions=3, seed=0)
    assert [len(r["extra_info"]["answers"]) for r in rows] == [1, 1, 1, 3] * 2
    env, info = load_env(BENCHMARKS / "envs" / "long_tail.py"), rows[3]["extra_info"]
    first = asyncio.run(env.step("", f"so <answer>{info['answers'][0]}</answer>", info))
    assert (first.reward, first.score, first.done) == (pytest.approx(1 / 3), pytest.approx(1 / 3), False)
    assert first.next_state[-1] == {"role": "user", "content": info["questions"][1]}
    second = asyncio.run(env.step("", "<answer>-1000</answer>", first.extra_info))
    assert (second.reward, second.score, second.done) == (pytest.approx(0.1 / 3), 0.0, False)
    last = asyncio.run(env.step("", "no tags", second.extra_info))
    assert (last.reward, last.done) == (0.0, True)
