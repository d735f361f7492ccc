"""DPO, ORPO, reward model and distillation end to end on tiny models."""

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.launch import read_metrics, run_ranks
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory):
    """Learnable preferences: the chosen answer ends in 'good', the rejected one in 'bad'."""
    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "green", "seven", "table", "light"]
    rows = []
    for i in range(40):
        body = " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))
        rows.append({"prompt": f"Question {i}: {body}?", "chosen": f"{body} good", "rejected": f"{body} bad"})
    folder = tmp_path_factory.mktemp("pairs")
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:32]))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[32:]))
    return folder


SECTION = {"dpo": "actor", "orpo": "actor", "rm": "critic", "distill": "actor"}


def args(kind, model, data, save_dir, *extra):
    section = SECTION[kind]
    train, test = (f"{data}/train.jsonl", f"{data}/test.jsonl")
    # AdamW's eps is 1e-6, not 1e-8: where a gradient nearly cancels, AdamW multiplies its rounding (which
    # differs between layouts) by up to lr / eps, beyond the weights' tolerance at the default.
    return ["-m", f"RL2.trainer.{kind}", f"data.train.path={train}", f"data.test.path={test}",
            "data.train.batch_size=8", f"{section}.model_name={model}", f"{section}.dtype=float32",
            f"{section}.optimizer.lr=1e-3", f"{section}.optimizer.eps=1e-6", f"{section}.max_length_per_device=256",
            f"trainer.save_dir={save_dir}", "trainer.total_steps=4", "trainer.test_freq=4", *extra]


def final(save_dir, kind):
    return load_file(str(save_dir / "final" / ("critic" if kind == "rm" else "actor") / "model.safetensors"))


@pytest.fixture(scope="module")
def sft_like_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distill")
    rows = [{"prompt": f"Count to {n}.", "response": " ".join(str(i) for i in range(1, n + 1))} for n in range(1, 21)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[16:]))
    return folder


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1)


def data_and_extra(kind, pair_data, sft_like_data, teacher_path):
    if kind == "distill":
        return sft_like_data, [f"actor.teacher_name={teacher_path}"]
    return pair_data, []


@pytest.fixture(scope="module")
def two_rank_run(tiny_model_path, pair_data, sft_like_data, teacher_path, tmp_path_factory):
    """kind -> the folder of its 2-rank run, saving at step 2, run once on first use: the 2-rank side of
    the equality test and the uninterrupted run of the resume test."""
    folders = {}

    def run(kind):
        if kind not in folders:
            data, extra = data_and_extra(kind, pair_data, sft_like_data, teacher_path)
            folders[kind] = tmp_path_factory.mktemp(f"{kind}_two_ranks")
            run_ranks(2, args(kind, tiny_model_path, data, folders[kind], "trainer.save_freq=2", *extra))
        return folders[kind]

    return run


@pytest.mark.parametrize("kind", ["dpo", "orpo", "rm", "distill"])
def test_two_ranks_equal_one_rank(kind, tiny_model_path, pair_data, sft_like_data, teacher_path, two_rank_run,
                                  tmp_path):
    data, extra = data_and_extra(kind, pair_data, sft_like_data, teacher_path)
    run_ranks(1, args(kind, tiny_model_path, data, tmp_path, *extra))
    runs = {nproc: (read_metrics(save_dir), final(save_dir, kind))
            for nproc, save_dir in ((1, tmp_path), (2, two_rank_run(kind)))}
    (metrics1, weights1), (metrics2, weights2) = runs[1], runs[2]
    for m1, m2 in zip(metrics1, metrics2):
        assert m1.keys() == m2.keys()
        for key in m1:
            if not key.startswith("perf/"):
                # gradient norms of small losses carry more round-off than the losses themselves
                rel = 1e-3 if key.endswith("grad_norm") else 1e-4
                assert m1[key] == pytest.approx(m2[key], rel=rel, abs=1e-6), key
    for key, value in weights1.items():
        torch.testing.assert_close(weights2[key], value, atol=2e-6, rtol=1e-4)
    before, after = metrics1[0], metrics1[-1]
    if kind == "rm":  # learnable preferences: accuracy on held-out pairs rises above chance
        assert before["test/accuracy"] <= 0.75 and after["test/accuracy"] == 1.0
    elif kind == "distill":  # the student moves toward the teacher
        assert after["test/loss"] < 0.8 * before["test/loss"]
    else:
        assert after["test/loss"] < before["test/loss"] and after["test/accuracy"] == 1.0


# The uninterrupted run is the equality test's 2-rank run: a resume costs one run more. ORPO and
# distillation resume through the same Trainer code as DPO: in the slow run only.
@pytest.mark.parametrize("kind", ["dpo", pytest.param("orpo", marks=pytest.mark.slow), "rm",
                                  pytest.param("distill", marks=pytest.mark.slow)])
def test_resume_equals_uninterrupted(kind, tiny_model_path, pair_data, sft_like_data, teacher_path, two_rank_run,
                                     tmp_path):
    data, extra = data_and_extra(kind, pair_data, sft_like_data, teacher_path)
    straight, resumed = two_rank_run(kind), tmp_path / "resumed"
    shutil.copytree(straight / "step2", resumed / "step2")
    run_ranks(2, args(kind, tiny_model_path, data, resumed, "trainer.load_ckpt_from=latest", *extra))
    for key, value in final(straight, kind).items():
        torch.testing.assert_close(final(resumed, kind)[key], value, atol=1e-6, rtol=1e-5)


def test_a_pair_over_the_reward_models_budget_names_its_key(tiny_model_path, pair_data, tmp_path):
    """The reward model is configured under critic.*: a pair too long for its micro-batches names that key."""
    over = [a for a in args("rm", tiny_model_path, pair_data, tmp_path) if "max_length_per_device" not in a]
    with pytest.raises(AssertionError, match=r"RL2 rm: .* not fit in critic.max_length_per_device=16; raise "
                                             r"critic.max_length_per_device"):
        run_ranks(1, over + ["critic.max_length_per_device=16"])


@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_packed_loss_equals_formula_on_separate_forwards(kind, tiny_model_path, pair_data, tmp_path):
    result = run_ranks(1, ["tests/e2e/scripts/preference_formulas.py", kind,
                           *args(kind, tiny_model_path, pair_data, tmp_path, "actor.beta=0.5")[2:]])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["packed"] == pytest.approx(report["direct"], rel=1e-4)


def test_distillation_compares_a_teacher_with_a_padded_vocabulary_over_the_shared_tokens(
        tiny_model_path, sft_like_data, tmp_path):
    """Sizes of one family pad their output layer differently (Qwen2.5: 151936 or 152064 rows for one
    tokenizer). A teacher that is the student with 64 padding rows added computes the student's
    distribution over the tokenizer's tokens: the KL to it is 0 and so is its gradient. At learning rate 0
    the student stays itself at every step (AdamW would turn the gradient's rounding noise into steps of
    the learning rate's size, and the KL's noise with them, more on some CPUs than on others)."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    rows = teacher.config.vocab_size
    teacher.resize_token_embeddings(rows + 64, mean_resizing=False)
    with torch.no_grad():  # padding rows a model never learnt to avoid: large logits for every input
        teacher.get_input_embeddings().weight[rows:] = 5.0
    teacher.save_pretrained(tmp_path / "padded")
    run_ranks(1, args("distill", tiny_model_path, sft_like_data, tmp_path / "run", "trainer.total_steps=2",
                      "trainer.test_freq=2", f"actor.teacher_name={tmp_path / 'padded'}", "actor.optimizer.lr=0"))
    metrics = read_metrics(tmp_path / "run")
    losses = [m[key] for m in metrics for key in ("train/loss", "test/loss") if key in m]
    assert len(losses) >= 3 and all(abs(loss) < 1e-6 for loss in losses), losses
    grad_norms = [m["train/grad_norm"] for m in metrics if "train/grad_norm" in m]
    assert len(grad_norms) == 2 and all(norm < 1e-5 for norm in grad_norms), grad_norms
