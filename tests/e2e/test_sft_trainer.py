"""SFT end to end: 1 rank vs 2 ranks, exact resume (TensorBoard's events rolled back with metrics.jsonl),
HF export."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.launch import read_metrics, run_ranks
from tests.helpers.tensorboard import TENSORBOARD_IF_INSTALLED, assert_tensorboard_equals_jsonl, needs_tensorboard
from tests.helpers.threads_at_exit import assert_a_finished_command_left_nothing, record_threads_at_exit


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    rows = [{"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}." + " Indeed." * (a % 5)}
            for a in range(6) for b in range(3)]
    rows.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "bye"}, {"role": "assistant", "content": "goodbye"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_args(model, data, save_dir, *extra):
    # AdamW's eps is 1e-6, not 1e-8: where a gradient nearly cancels, AdamW multiplies its rounding (which
    # differs between layouts) by up to lr / eps, beyond the weights' tolerance at the default.
    return ["-m", "RL2.trainer.sft", f"data.train.path={data}", "data.train.batch_size=6",
            f"actor.model_name={model}", "actor.dtype=float32", "actor.optimizer.lr=1e-3", "actor.optimizer.eps=1e-6",
            "actor.max_length_per_device=160", "actor.scheduler.name=cosine", "actor.scheduler.warmup_ratio=0.25",
            f"trainer.save_dir={save_dir}", "trainer.total_steps=4", *extra]


def final_weights(save_dir):
    return load_file(str(save_dir / "final" / "actor" / "model.safetensors"))


def layout_args(nproc, avg_level):
    # The 1-rank sequence-level run recomputes every layer's activations, the 2-rank token-level run
    # only the first layer's (of two): neither may change the result.
    checkpointing = (nproc, avg_level) in ((1, "sequence"), (2, "token"))
    return [f"actor.avg_level={avg_level}", f"actor.enable_gradient_checkpointing={checkpointing}",
            f"actor.checkpoint_every_n_layers={nproc}"]


@pytest.fixture(scope="module")
def two_rank_run(tiny_model_path, sft_data, tmp_path_factory):
    """The 2-rank token-level run, saving at step 2: the 2-rank side of the token-level equality test and
    the uninterrupted run of the resume test. It writes TensorBoard's events as well (rank 0 only), and
    its processes record the threads they leave at exit (in `exit_records`)."""
    save_dir = tmp_path_factory.mktemp("two_ranks")
    with pytest.MonkeyPatch.context() as monkeypatch:
        record_threads_at_exit(save_dir / "exit_records", monkeypatch)
        result = run_ranks(2, sft_args(tiny_model_path, sft_data, save_dir, *layout_args(2, "token"),
                                       "trainer.save_freq=2", *TENSORBOARD_IF_INSTALLED))
    (save_dir / "stderr.txt").write_text(result.stderr)
    return save_dir


def test_a_run_prints_no_warning_raised_in_rl2s_own_code(two_rank_run):
    """Python prints a warning as `file:line: Category: message`; none may come from a line of RL2's (a
    warning that every run prints hides the ones that matter)."""
    stderr = (two_rank_run / "stderr.txt").read_text()
    assert not re.findall(r"/RL2/[\w/]+\.py:\d+: \w*Warning: .*", stderr)


def test_a_finished_run_leaves_no_group_threads(two_rank_run):
    """See test_process_group_teardown.py: torchrun's ranks free their groups before the interpreter exits."""
    assert_a_finished_command_left_nothing(two_rank_run / "exit_records", 2)


@pytest.mark.parametrize("avg_level", ["token", "sequence"])
def test_two_ranks_equal_one_rank(tiny_model_path, sft_data, tmp_path, avg_level, request):
    runs = {}
    for nproc in (1, 2):
        if (nproc, avg_level) == (2, "token"):
            save_dir = request.getfixturevalue("two_rank_run")
        else:
            save_dir = tmp_path / f"ranks{nproc}"
            run_ranks(nproc, sft_args(tiny_model_path, sft_data, save_dir, *layout_args(nproc, avg_level)))
        runs[nproc] = (read_metrics(save_dir), final_weights(save_dir))
    (metrics1, weights1), (metrics2, weights2) = runs[1], runs[2]
    losses1 = [m["train/loss"] for m in metrics1]
    assert losses1 == pytest.approx([m["train/loss"] for m in metrics2], rel=1e-5)
    assert losses1[-1] < losses1[0]
    initial = load_file(f"{tiny_model_path}/model.safetensors")
    for key, value in weights1.items():
        torch.testing.assert_close(weights2[key], value, atol=2e-6, rtol=1e-4)
    assert any(not torch.equal(initial[k], weights1[k]) for k in initial)  # training changed the weights


@needs_tensorboard
def test_resume_equals_uninterrupted(tiny_model_path, sft_data, two_rank_run, tmp_path):
    straight = two_rank_run
    assert (straight / "step2" / "trainer_state.json").exists()
    assert_tensorboard_equals_jsonl(straight)
    # Simulate a run killed after step 3: only the step-2 checkpoint survives, plus a half-written save;
    # TensorBoard's events reach step 4, metrics.jsonl step 3. The resume rolls both back to step 2.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "step2", resumed / "step2")
    shutil.copytree(straight / "tensorboard", resumed / "tensorboard")
    (resumed / ".step4.tmp").mkdir()
    (resumed / "metrics.jsonl").write_text("".join(
        json.dumps(m) + "\n" for m in read_metrics(straight)[:3]))
    run_ranks(2, sft_args(tiny_model_path, sft_data, resumed, *layout_args(2, "token"), "trainer.save_freq=2",
                          "trainer.load_ckpt_from=latest", "trainer.use_tensorboard=true"))
    for key, value in final_weights(straight).items():
        torch.testing.assert_close(final_weights(resumed)[key], value, atol=1e-6, rtol=1e-5)
    assert [m["step"] for m in read_metrics(resumed)] == [1, 2, 3, 4]
    assert [m["train/loss"] for m in read_metrics(resumed)] == pytest.approx(
        [m["train/loss"] for m in read_metrics(straight)], rel=1e-5)
    assert_tensorboard_equals_jsonl(resumed)
    assert len(list((resumed / "tensorboard").glob("events.out.tfevents.*"))) == 2  # rank 0 only, one per run


def test_resume_with_other_model_settings_names_the_checkpoint_and_the_difference(tiny_model_path, sft_data,
                                                                                   two_rank_run, tmp_path):
    """A checkpoint of full fine-tuning (the 2-rank run's) resumed with LoRA on: every rank stops with a
    message, not DCP's traceback of its load plan."""
    shutil.copytree(two_rank_run / "step2", tmp_path / "step2")
    with pytest.raises(AssertionError) as failure:
        run_ranks(2, sft_args(tiny_model_path, sft_data, tmp_path, "trainer.load_ckpt_from=latest",
                              "actor.lora.rank=4"),
                  timeout=120)
    message = (rf"RL2 sft: trainer\.load_ckpt_from: {tmp_path}/step2 does not hold what this run's models are made of "
               r"\(RuntimeError: Missing key in checkpoint state_dict: "
               r"actor\.model\.model\.layers\.0\..*lora_A\.weight\."
               r"\); resume with the model settings of the run that saved it \(model_name, lora\.\*\)")
    # Each rank finds the mismatch itself; torchrun may stop the slower rank before it prints its message.
    assert re.search(message, str(failure.value)), str(failure.value)[-3000:]
    assert "CheckpointException" not in str(failure.value)


def test_export_reloads_with_same_logits(tiny_model_path, sft_data, tmp_path):
    result = run_ranks(1, ["tests/e2e/scripts/export_roundtrip.py", *sft_args(tiny_model_path, sft_data, tmp_path)[2:]])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["changed"] > 0
    assert report["max_logit_diff"] < 1e-4


def test_bad_config_and_data_exit_with_message(tiny_model_path, sft_data, tmp_path):
    with pytest.raises(AssertionError, match="unknown config key 'actor.learning_rate'"):
        run_ranks(1, sft_args(tiny_model_path, sft_data, tmp_path, "actor.learning_rate=1"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(AssertionError, match=r"bad.jsonl row 1: missing key 'response'"):
        run_ranks(1, sft_args(tiny_model_path, bad, tmp_path))


def test_bf16_compute_keeps_fp32_master_weights(tiny_model_path, sft_data, tmp_path):
    args = [a for a in sft_args(tiny_model_path, sft_data, tmp_path, "trainer.total_steps=3") if "dtype" not in a]
    run_ranks(1, args + ["actor.dtype=bfloat16"])
    losses = [m["train/loss"] for m in read_metrics(tmp_path)]
    # A freshly initialised model predicts nearly uniformly over the 49152-token vocabulary.
    assert losses[0] == pytest.approx(math.log(49152), abs=0.1)
    assert losses[-1] < losses[0]
    assert all(w.dtype == torch.float32 for w in final_weights(tmp_path).values())
    # The model's own config, not training's: use_cache is off only while the trainer runs it.
    exported = json.loads((tmp_path / "final" / "actor" / "config.json").read_text())
    loaded = json.loads((Path(tiny_model_path) / "config.json").read_text())
    assert exported["use_cache"] is True and loaded.get("use_cache", True) is True


@pytest.mark.parametrize("avg_level", ["token", "sequence"])
def test_test_loss_averages_over_the_whole_test_set(tiny_model_path, sft_data, tmp_path, avg_level):
    """Test batches of unequal sizes (19 rows in batches of 4) and lengths: the test loss is the mean
    over every trained token of the test set (token) or over every example (sequence)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from RL2.config.schema import SplitConfig
    from RL2.datasets.sft import sft_row_tokenizer

    run_ranks(1, sft_args(tiny_model_path, sft_data, tmp_path, f"data.test.path={sft_data}", "data.test.batch_size=4",
                          f"actor.avg_level={avg_level}", "trainer.eval_only=true"))
    reported = read_metrics(tmp_path)[-1]["test/loss"]
    tokenize = sft_row_tokenizer(AutoTokenizer.from_pretrained(tiny_model_path))(SplitConfig())
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    token_losses, example_losses = [], []
    for line in sft_data.read_text().splitlines():
        example = tokenize(json.loads(line))
        ids, trained = torch.tensor([example["input_ids"]]), torch.tensor(example["loss_mask"][1:], dtype=torch.bool)
        with torch.no_grad():
            logps = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[0].float(), -1)
        nll = -logps.gather(-1, ids[0, 1:, None])[:, 0][trained]
        token_losses += nll.tolist()
        example_losses.append(nll.mean().item())
    expected = (sum(token_losses) / len(token_losses) if avg_level == "token"
                else sum(example_losses) / len(example_losses))
    assert reported == pytest.approx(expected, rel=1e-4)
