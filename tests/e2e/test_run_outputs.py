"""What a run leaves in its save_dir across runs: resuming a finished run, evaluating a checkpoint,
a run killed mid-write, a checkpoint of another run's length."""

import json

import pytest

from tests.helpers.launch import read_metrics, run_ranks


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("outputs") / "train.jsonl"
    rows = [{"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."}
            for a in range(4) for b in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft(model, data, save_dir, *extra):
    return run_ranks(1, ["-m", "RL2.trainer.sft", f"data.train.path={data}", f"data.test.path={data}",
                         "data.train.batch_size=4", "data.test.batch_size=4", f"actor.model_name={model}",
                         "actor.dtype=float32", "actor.max_length_per_device=128", f"trainer.save_dir={save_dir}",
                         "trainer.test_freq=2", *extra])


def steps_and_kinds(save_dir):
    return [(m["step"], "train/loss" in m, "test/loss" in m) for m in read_metrics(save_dir)]


def test_resume_evaluate_and_rerun_keep_one_history(tiny_model_path, sft_data, tmp_path):
    run = tmp_path / "run"
    sft(tiny_model_path, sft_data, run, "trainer.total_steps=3", "trainer.save_freq=3")
    # step 0 evaluated before training, step 2 by test_freq, the last step with its own record
    history = [(0, False, True), (1, True, False), (2, True, True), (3, True, True)]
    assert steps_and_kinds(run) == history

    sft(tiny_model_path, sft_data, run, "trainer.total_steps=3", "trainer.load_ckpt_from=latest")
    assert steps_and_kinds(run) == history  # a finished run resumed: nothing to redo, nothing logged twice

    sft(tiny_model_path, sft_data, run, "trainer.eval_only=true", "trainer.load_ckpt_from=step3")
    assert steps_and_kinds(run) == history + [(3, False, True)]  # an evaluation adds to the history

    with pytest.raises(AssertionError, match=r"step3 is step 3, past this run's 2 steps"):
        sft(tiny_model_path, sft_data, run, "trainer.total_steps=2", "trainer.load_ckpt_from=latest")

    # A run killed mid-write leaves half a line; the next run's records start on a line of their own.
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train/lo')
    assert not (run / "learning_curve.png").exists()  # run_ranks' trainer.plot_learning_curve=false
    sft(tiny_model_path, sft_data, run, "trainer.total_steps=1", "trainer.test_freq=null",
        "trainer.plot_learning_curve=true")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[-2] == '{"step": 4, "train/lo' and json.loads(lines[-1])["step"] == 1
    assert (run / "final" / "actor" / "model.safetensors").exists()
    assert (run / "learning_curve.png").stat().st_size > 0  # its learning curve read past the torn line
