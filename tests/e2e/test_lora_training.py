"""LoRA (`actor.lora.rank`, `critic.lora.rank`): only the adapters (and a reward model's head) train and
fill the optimizer and checkpoints; the merged export equals base + (alpha / r) B A computed from the
saved tensors, and the PEFT adapter folder loads with `peft`; 2 ranks (FSDP or tensor parallel) equal
1 rank; a resumed run ends where an uninterrupted one does; DPO's and PPO's reference is the base with
the adapters off; the rollout engine samples the merged weights after every update."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from tests.helpers import ENVS
from tests.helpers.launch import read_metrics, run_ranks
from tests.helpers.lora import expected_merge
from tests.helpers.tiny import make_tiny_qwen, sharpened_copy

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = [f"actor.lora.rank={RANK}", f"actor.lora.alpha={ALPHA}"]


def assert_merged_export(folder: Path, base_folder: str) -> dict[str, torch.Tensor]:
    """The exported folder is base + scaled BA; only adapted layers differ from the base. Returns the adapter."""
    merged, base = load_file(f"{folder}/model.safetensors"), load_file(f"{base_folder}/model.safetensors")
    adapter = load_file(f"{folder}/adapter/adapter_model.safetensors")
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert config["target_modules"] == sorted(TARGETS)
    adapted = {k for k in base if f"base_model.model.{k.removesuffix('.weight')}.lora_A.weight" in adapter}
    assert {k.rsplit(".", 2)[-2] for k in adapted} == set(TARGETS) and len(adapted) == 2 * len(TARGETS)
    expected = expected_merge(base, adapter, SCALE)
    for key, value in merged.items():
        if key in adapted:
            torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=1e-6)
        elif key in base:
            assert torch.equal(value, base[key]), key  # embeddings, norms: frozen
    assert all(adapter[k].abs().sum() > 0 for k in adapter if "lora_B" in k)  # B left zero: the adapters trained
    return adapter


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> str:
    """Untied embeddings and 4 key/value heads: tensor parallelism splits it 2 ways."""
    return make_tiny_qwen(tmp_path_factory.mktemp("lora_qwen"), "qwen2")


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lora_sft") / "train.jsonl"
    rows = [{"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."}
            for a in range(6) for b in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_args(model, data, save_dir, *extra):
    return ["-m", "RL2.trainer.sft", f"data.train.path={data}", "data.train.batch_size=6", f"actor.model_name={model}",
            "actor.dtype=float32", "actor.optimizer.lr=1e-2", "actor.max_length_per_device=160",
            f"trainer.save_dir={save_dir}", "trainer.total_steps=4", "trainer.save_freq=2", *LORA, *extra]


@pytest.fixture(scope="module")
def sft_run(qwen_path, sft_data, tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("lora_sft_run")
    run_ranks(1, sft_args(qwen_path, sft_data, save_dir))
    return save_dir


def test_sft_trains_only_the_adapters(sft_run, qwen_path):
    losses = [m["train/loss"] for m in read_metrics(sft_run)]
    assert losses[-1] < losses[0]
    assert_merged_export(sft_run / "final" / "actor", qwen_path)
    # The checkpoint holds the adapters and their Adam state, nothing else of the model.
    saved = dcp.FileSystemReader(str(sft_run / "step2")).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("actor.model.") for k in saved if k.startswith("actor.model.")}
    assert model_keys and all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in model_keys)
    optimizer_params = {k.removeprefix("actor.optimizer.state.").rsplit(".", 1)[0] for k in saved
                        if k.startswith("actor.optimizer.state.")}
    assert optimizer_params == model_keys


def test_peft_loads_the_adapter_folder(sft_run, qwen_path):
    peft = pytest.importorskip("peft")
    folder = sft_run / "final" / "actor"
    ids = torch.tensor([[1, 20, 300, 4000, 50, 6]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(qwen_path)
        base_logits = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, folder / "adapter")(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
    torch.testing.assert_close(adapted, merged, atol=1e-5, rtol=1e-5)
    assert (adapted - base_logits).abs().max() > 1e-2


@pytest.mark.parametrize("layout", ["actor.tp_size=1", pytest.param("actor.tp_size=2", marks=pytest.mark.slow)])
def test_sft_two_ranks_equal_one_rank(sft_run, qwen_path, sft_data, tmp_path, layout):
    """FSDP over 2 ranks, or tensor parallelism (adapters split with their layer), against the 1-rank run."""
    run_ranks(2, sft_args(qwen_path, sft_data, tmp_path, layout))
    assert [m["train/loss"] for m in read_metrics(tmp_path)] == pytest.approx(
        [m["train/loss"] for m in read_metrics(sft_run)], rel=1e-5)
    one = load_file(f"{sft_run}/final/actor/adapter/adapter_model.safetensors")
    two = load_file(f"{tmp_path}/final/actor/adapter/adapter_model.safetensors")
    assert one.keys() == two.keys()
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def test_sft_resume_equals_uninterrupted(sft_run, qwen_path, sft_data, tmp_path):
    shutil.copytree(sft_run / "step2", tmp_path / "step2")
    run_ranks(1, sft_args(qwen_path, sft_data, tmp_path, "trainer.load_ckpt_from=latest"))
    assert [m["train/loss"] for m in read_metrics(tmp_path)] == pytest.approx(
        [m["train/loss"] for m in read_metrics(sft_run)][2:], rel=1e-6)
    straight = load_file(f"{sft_run}/final/actor/model.safetensors")
    for key, value in load_file(f"{tmp_path}/final/actor/model.safetensors").items():
        torch.testing.assert_close(value, straight[key], atol=1e-7, rtol=1e-6)


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory) -> Path:
    words = ["apple", "river", "stone", "cloud", "green", "seven"]
    rows = [{"prompt": f"Question {i}: {words[i % 6]} {words[i * 5 % 6]}?", "chosen": f"{words[i % 6]} good",
             "rejected": f"{words[i * 5 % 6]} bad"} for i in range(16)]
    path = tmp_path_factory.mktemp("lora_pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair_args(kind, model, data, save_dir, *extra):
    section = "critic" if kind == "rm" else "actor"
    return ["-m", f"RL2.trainer.{kind}", f"data.train.path={data}", "data.train.batch_size=8",
            f"{section}.model_name={model}", f"{section}.dtype=float32", f"{section}.optimizer.lr=1e-2",
            f"{section}.max_length_per_device=256", f"trainer.save_dir={save_dir}", "trainer.total_steps=3",
            f"{section}.lora.rank={RANK}", f"{section}.lora.alpha={ALPHA}", *extra]


@pytest.fixture(scope="module")
def dpo_run(qwen_path, pair_data, tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("lora_dpo")
    run_ranks(2, pair_args("dpo", qwen_path, pair_data, save_dir))
    return save_dir


def test_dpo_reference_is_the_base(dpo_run, qwen_path):
    first, *later = read_metrics(dpo_run)
    # Policy and reference agree at the start (B = 0): every pair's implicit reward margin is 0.
    assert first["train/loss"] == pytest.approx(0.6931472, abs=1e-6) and first["train/margin"] == 0
    assert all(abs(m["train/margin"]) > 1e-4 for m in later)  # the adapters moved away from the base
    assert_merged_export(dpo_run / "final" / "actor", qwen_path)


@pytest.mark.slow
def test_dpo_two_ranks_equal_one_rank(dpo_run, qwen_path, pair_data, tmp_path):
    run_ranks(1, pair_args("dpo", qwen_path, pair_data, tmp_path))
    one, two = read_metrics(tmp_path), read_metrics(dpo_run)
    for key in ("train/loss", "train/margin", "train/chosen_logps"):
        assert [m[key] for m in two] == pytest.approx([m[key] for m in one], rel=1e-5, abs=1e-7), key


def test_reward_model_trains_adapters_and_its_head(qwen_path, pair_data, tmp_path):
    """RL2's all-linear (every linear layer of the decoder layers) is written out for PEFT by name."""
    run_ranks(1, pair_args("rm", qwen_path, pair_data, tmp_path, "critic.lora.target_modules=[all-linear]"))
    folder = tmp_path / "final" / "critic"
    merged, base = load_file(f"{folder}/model.safetensors"), load_file(f"{qwen_path}/model.safetensors")
    adapter = load_file(f"{folder}/adapter/adapter_model.safetensors")
    torch.testing.assert_close(adapter["base_model.model.score.weight"], merged["score.weight"])
    for key, value in expected_merge(base, adapter, SCALE).items():
        if key != "lm_head.weight":  # a token classifier has no LM head
            torch.testing.assert_close(merged[key], value, atol=1e-6, rtol=1e-6)
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert (config["task_type"], config["modules_to_save"]) == ("TOKEN_CLS", ["score"])
    assert config["target_modules"] == sorted(TARGETS)
    peft = pytest.importorskip("peft")
    ids = torch.tensor([[1, 20, 300, 4000, 50, 6]])
    with torch.no_grad():
        exported = AutoModelForTokenClassification.from_pretrained(folder)(ids).logits
        base_model = AutoModelForTokenClassification.from_pretrained(qwen_path, num_labels=1)
        adapted = peft.PeftModel.from_pretrained(base_model, folder / "adapter")(ids).logits
    torch.testing.assert_close(adapted, exported, atol=1e-5, rtol=1e-5)


ENV = ENVS / "emit_token.py"


@pytest.fixture(scope="module")
def repeat_model(tmp_path_factory) -> str:
    from tests.helpers.tiny import make_tiny_model

    folder = tmp_path_factory.mktemp("lora_repeat")
    return sharpened_copy(make_tiny_model(folder / "tiny"), folder / "sharp")


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lora_rl") / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {k}", "extra_info": {}}) + "\n" for k in range(16)))
    return path


def ppo_args(model, data, save_dir, *extra):
    return ["-m", "RL2.trainer.ppo", f"data.train.path={data}", "data.train.batch_size=4", f"rollout.env_path={ENV}",
            "rollout.responses_per_prompt=4", "rollout.train_sampling_params.max_new_tokens=4",
            f"actor.model_name={model}", "actor.dtype=float32", "actor.optimizer.lr=2e-3",
            "actor.max_length_per_device=512", f"trainer.save_dir={save_dir}", "trainer.total_steps=4",
            "actor.kl.coef=0.01", "actor.kl.type=reward", "actor.kl.estimator=k1", "actor.kl.reset_every=2",
            "trainer.save_freq=2", *LORA, *extra]


@pytest.fixture(scope="module")
def ppo_run(repeat_model, rl_data, tmp_path_factory) -> Path:
    save_dir = tmp_path_factory.mktemp("lora_ppo")
    run_ranks(2, ppo_args(repeat_model, rl_data, save_dir))
    return save_dir


def test_ppo_engine_samples_merged_weights_and_resets_move_the_base(ppo_run):
    metrics = read_metrics(ppo_run)
    # The trainer recomputes the log-probabilities of the engine's samples: equal at every step, so the
    # merged weights reached the engines after every update.
    assert all(m["actor/engine_mismatch"] < 1e-5 for m in metrics), [m["actor/engine_mismatch"] for m in metrics]
    assert [m["actor/ref_reset"] for m in metrics] == [0.0, 1.0, 0.0, 1.0]
    # The reference is the base: step 2 samples an actor that left it; a reset moved it to the actor of
    # step 3, which samples with the reference's weights.
    # (k1 is a one-sample estimate of the KL: it may be negative.)
    assert [abs(m["actor/ref_kl"]) < 1e-5 for m in metrics] == [True, False, True, False]
    assert abs(metrics[1]["actor/ref_kl"]) > 1e-3
    assert not (ppo_run / "final" / "actor" / "adapter").exists()  # no adapter of the loaded base expresses it
    assert not (ppo_run / "final" / "ref").exists()


@pytest.mark.slow
def test_ppo_resume_equals_uninterrupted(ppo_run, repeat_model, rl_data, tmp_path):
    """The step-2 checkpoint holds the base the reset changed, with the adapters (SFT's resume is the
    default test of adapter-only checkpoints)."""
    shutil.copytree(ppo_run / "step2", tmp_path / "step2")
    run_ranks(2, ppo_args(repeat_model, rl_data, tmp_path, "trainer.load_ckpt_from=latest"))
    straight, resumed = read_metrics(ppo_run)[2:], read_metrics(tmp_path)
    for key in ("rollout/reward", "actor/loss", "actor/ref_kl"):
        assert [m[key] for m in resumed] == pytest.approx([m[key] for m in straight], abs=1e-6), key
    expected = load_file(f"{ppo_run}/final/actor/model.safetensors")
    for key, value in load_file(f"{tmp_path}/final/actor/model.safetensors").items():
        torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=1e-5)
