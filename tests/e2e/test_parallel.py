"""Parallel layouts (data, tensor, context, hybrid sharding) against one plain process.

The reference is a Hugging Face model run sequence by sequence in this process, with no packing and
no RL2 code on the path: the loss, per-token log-probs, entropies, gradients and the weights after
one AdamW step of every layout must equal it. The weights compared are those the embedded engine
receives (`full_tensors`) and those the export writes.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.e2e.scripts.parallel_equivalence import ENTROPY_COEF, EPS, LENGTHS, LR, examples
from tests.helpers import ENVS
from tests.helpers.launch import read_metrics, run_ranks
from tests.helpers.tiny import make_tiny_qwen, sharpened_copy, tokenizer

SCRIPT = "tests/e2e/scripts/parallel_equivalence.py"


@pytest.fixture(scope="module")
def llama_path(tiny_model_path, tmp_path_factory) -> str:
    return sharpened_copy(tiny_model_path, tmp_path_factory.mktemp("sharp_llama"))


@pytest.fixture(scope="module")
def qwen_paths(tmp_path_factory) -> dict[str, str]:
    return {family: sharpened_copy(make_tiny_qwen(tmp_path_factory.mktemp(family), family),
                            tmp_path_factory.mktemp(f"sharp_{family}")) for family in ("qwen2", "qwen3")}


def reference(path: str) -> dict:
    """The same step on one process: per-sequence forward with sdpa, clip to norm 1, AdamW."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    batch = examples()
    n_trained = sum(sum(ex["loss_mask"][1:]) for ex in batch)
    loss_sum, logps, entropies = 0.0, [], []
    for ex in batch:
        ids = torch.tensor([ex["input_ids"]])
        logits = model(input_ids=ids[:, :-1]).logits.float()
        log_probs = torch.log_softmax(logits, -1)
        token_logps = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        weights = torch.tensor([ex["loss_mask"][1:]], dtype=torch.float32) / n_trained
        loss = ((-token_logps - ENTROPY_COEF * entropy) * weights).sum()
        loss.backward()
        loss_sum += loss.item()
        logps.append(token_logps[0].detach())
        entropies.append(entropy[0].detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0).step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"loss": loss_sum, "grad_norm": grad_norm, "logps": logps, "entropy": entropies, "grads": grads,
            "params": params}


def assert_equal_to_reference(result: dict, ref: dict, trained_only: bool = False) -> None:
    """`trained_only`: the layout computed logits at trained tokens only; the others must read 0."""
    assert result["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert result["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    masks = [torch.tensor(ex["loss_mask"][1:], dtype=torch.float32) if trained_only else 1.0 for ex in examples()]
    for ours, theirs, mask in zip(result["logps"], ref["logps"], masks):
        torch.testing.assert_close(ours, theirs * mask, atol=1e-5, rtol=1e-5)
    for ours, theirs, mask in zip(result["entropy"], ref["entropy"], masks):
        torch.testing.assert_close(ours, theirs * mask, atol=1e-4, rtol=1e-5)
    assert set(result["grads"]) == set(ref["grads"])
    for name, grad in ref["grads"].items():
        # fp32 sums in another order: errors ~1e-5 of the tensor's largest entry.
        torch.testing.assert_close(result["grads"][name], grad, atol=2e-4 * grad.abs().max().item(), rtol=1e-3,
                                   msg=lambda m: f"gradient of {name}: {m}")
    for source in ("synced", "exported"):
        for name, param in ref["params"].items():
            torch.testing.assert_close(result[source][name], param, atol=1e-6, rtol=1e-5,
                                       msg=lambda m: f"{source} {name} after one step: {m}")


def run_layouts(tmp_path, nproc: int, specs: list[str]) -> dict:
    out = tmp_path / "layouts.pt"
    run_ranks(nproc, [SCRIPT, str(out), *specs], timeout=600)
    return torch.load(out)


def test_two_rank_layouts_equal_one_process(llama_path, tmp_path):
    """dp=2 (fsdp), tp=2 and cp=2 on the tied-embedding Llama; cp=2 trains a sequence longer than one rank's
    budget, recomputing activations in backward (the K/V all-gathers run again). tp=2 and cp=2 compute
    logits at trained tokens only, as the trainers do."""
    specs = [f"{llama_path}@tp=1", f"{llama_path}@tp=2,trained=1", f"{llama_path}@cp=2,ac=1,trained=1"]
    results = run_layouts(tmp_path, 2, specs)
    ref = reference(llama_path)
    for spec in specs:
        assert_equal_to_reference(results[spec], ref, trained_only="trained=1" in spec)
    assert max(LENGTHS) - 1 > results[specs[2]]["max_length_per_device"]


def test_hybrid_sharding_and_tp_with_cp_four_ranks(llama_path, qwen_paths, tmp_path):
    """ddp=2 x fsdp=2 (replicate x shard) and tp=2 x cp=2 on Qwen3 (per-head q/k norms, untied head),
    the latter with logits at trained tokens only."""
    specs = [f"{llama_path}@ddp=2", f"{qwen_paths['qwen3']}@tp=2,cp=2,trained=1"]
    results = run_layouts(tmp_path, 4, specs)
    assert results[specs[0]]["fsdp"] == 2
    assert_equal_to_reference(results[specs[0]], reference(llama_path))
    assert_equal_to_reference(results[specs[1]], reference(qwen_paths["qwen3"]), trained_only=True)


@pytest.mark.slow
def test_data_and_tensor_parallel_four_ranks(llama_path, qwen_paths, tmp_path):
    """dp=2 x tp=2 on Qwen2 (q/k/v biases) and Qwen3, tp=2 x cp=2 on the tied Llama, and ddp=2 x tp=2."""
    specs = [f"{qwen_paths['qwen2']}@tp=2", f"{qwen_paths['qwen3']}@tp=2", f"{llama_path}@tp=2,cp=2",
             f"{llama_path}@ddp=2,tp=2"]
    results = run_layouts(tmp_path, 4, specs)
    for spec, path, fsdp in zip(specs, (qwen_paths["qwen2"], qwen_paths["qwen3"], llama_path, llama_path),
                                (2, 2, 1, 1)):
        assert results[spec]["fsdp"] == fsdp
        assert_equal_to_reference(results[spec], reference(path))


@pytest.fixture(scope="module")
def long_sft_data(tmp_path_factory):
    """Responses up to ~110 tokens: longer than the 64-token budget of one rank used below."""
    path = tmp_path_factory.mktemp("sft_long") / "train.jsonl"
    rows = [{"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}." + " Indeed." * (4 * a)}
            for a in range(6) for b in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_args(model, data, save_dir, *extra):
    # AdamW's eps is 1e-6, not 1e-8: where a gradient nearly cancels, AdamW multiplies its rounding (which
    # differs between layouts) by up to lr / eps, beyond the weights' tolerance at the default.
    return ["-m", "RL2.trainer.sft", f"data.train.path={data}", "data.train.batch_size=6",
            f"actor.model_name={model}", "actor.dtype=float32", "actor.optimizer.lr=1e-3", "actor.optimizer.eps=1e-6",
            f"trainer.save_dir={save_dir}", "trainer.total_steps=3", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["actor.tp_size=2", "actor.cp_size=2"])
def test_sft_tp_or_cp_equals_one_rank(tiny_model_path, long_sft_data, tmp_path, layout):
    from safetensors.torch import load_file

    tok = tokenizer()
    longest = max(len(tok.apply_chat_template(
        [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}],
        return_dict=True)["input_ids"]) for r in map(json.loads, long_sft_data.read_text().splitlines()))
    assert longest > 64
    run_ranks(1, sft_args(tiny_model_path, long_sft_data, tmp_path / "one", "actor.max_length_per_device=128"))
    run_ranks(2, sft_args(tiny_model_path, long_sft_data, tmp_path / "two", "actor.max_length_per_device=64", layout))
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [m["train/loss"] for m in two] == pytest.approx([m["train/loss"] for m in one], rel=1e-5)
    assert [m["train/tokens"] for m in two] == [m["train/tokens"] for m in one]
    expected = load_file(str(tmp_path / "one" / "final" / "actor" / "model.safetensors"))
    for key, value in load_file(str(tmp_path / "two" / "final" / "actor" / "model.safetensors")).items():
        torch.testing.assert_close(value, expected[key], atol=2e-6, rtol=1e-4)


@pytest.fixture(scope="module")
def repeat_model(tiny_model_path, tmp_path_factory) -> str:
    return sharpened_copy(tiny_model_path, tmp_path_factory.mktemp("repeat_model"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp_size=2", "cp_size=2"])
def test_ppo_steps_with_tp_or_cp(repeat_model, tmp_path, layout):
    """Two GRPO steps with a critic-free actor under tp=2 or cp=2: the trainer's log-probs of the sampled
    tokens equal the engine's before and after a weight sync from the split parameters."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {k}", "extra_info": {}}) + "\n" for k in range(8)))
    env = ENVS / "emit_token.py"
    run_ranks(2, ["-m", "RL2.trainer.ppo", f"data.train.path={data}", "data.train.batch_size=4",
                  f"rollout.env_path={env}", "rollout.responses_per_prompt=4",
                  "rollout.train_sampling_params.max_new_tokens=4", f"actor.model_name={repeat_model}",
                  "actor.dtype=float32", "actor.optimizer.lr=1e-3", "actor.max_length_per_device=32",
                  "actor.kl.coef=0.01", f"actor.{layout}", f"trainer.save_dir={tmp_path / 'run'}",
                  "trainer.total_steps=2"])
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    assert all(m["actor/engine_mismatch"] < 1e-4 for m in metrics)
    assert metrics[0]["actor/grad_norm"] > 0  # the first update moved the weights the second step samples from


PPO_UPDATE = ["actor.dtype=float32", "actor.optimizer.lr=1e-3", "actor.max_length_per_device=48",
              "actor.update_per_rollout=2", "actor.mini_batch_size=3", "actor.kl.coef=0.1", "actor.entropy.coef=0.01",
              "actor.dual_clip=3", "actor.tis_coef=2", "actor.clip_high=0.28", "actor.avg_level=sequence",
              "adv.estimator=gae", "critic.value_clip=0.2", "critic.mini_batch_size=3", "critic.optimizer.lr=1e-3",
              "critic.dtype=float32", "critic.max_length_per_device=48",
              # The policy at a sampling temperature: a vocabulary split over tp ranks divides its logits too.
              "rollout.train_sampling_params.temperature=0.7",
              # Adam with eps=1e-8 turns round-off in the near-zero gradients of unused embedding rows into
              # steps of +-lr; a larger eps keeps the weight comparison about the real gradients.
              "actor.optimizer.eps=1e-4", "critic.optimizer.eps=1e-4"]


@pytest.fixture(scope="module")
def ppo_update_one_rank(tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_update") / "one.pt"
    result = run_ranks(1, ["tests/e2e/scripts/ppo_update.py", str(out), f"actor.model_name={tiny_model_path}",
                           *PPO_UPDATE])
    return json.loads(result.stdout.strip().splitlines()[-1])["metrics"], torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("degree", ["tp_size=2", "cp_size=2"])
def test_ppo_update_with_tp_or_cp_equals_one_rank(tiny_model_path, ppo_update_one_rank, tmp_path, degree):
    """Actor (clipped loss, KL, entropy, TIS) and critic (scalar head, value clipping) over two epochs of
    mini-batches: metrics and weights equal the one-rank run."""
    out = tmp_path / "two.pt"
    result = run_ranks(2, ["tests/e2e/scripts/ppo_update.py", str(out), f"actor.model_name={tiny_model_path}",
                           *PPO_UPDATE, f"actor.{degree}", f"critic.{degree}"])
    metrics, weights = json.loads(result.stdout.strip().splitlines()[-1])["metrics"], torch.load(out)
    expected_metrics, expected_weights = ppo_update_one_rank
    assert metrics == pytest.approx(expected_metrics, rel=1e-4, abs=1e-6)
    for role in ("actor", "critic"):
        for key, value in expected_weights[role].items():
            torch.testing.assert_close(weights[role][key], value, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_distillation_with_tp_equals_one_rank(llama_path, long_sft_data, tmp_path):
    """The full-vocabulary KL to a teacher, reduced over the vocabulary slices of tp=2."""
    from tests.helpers.tiny import make_tiny_model

    teacher = make_tiny_model(tmp_path / "teacher", seed=3)
    args = ["-m", "RL2.trainer.distill", f"data.train.path={long_sft_data}", "data.train.batch_size=6",
            f"actor.model_name={llama_path}", f"actor.teacher_name={teacher}", "actor.dtype=float32",
            "actor.optimizer.lr=1e-3", "actor.max_length_per_device=160", "trainer.total_steps=2"]
    run_ranks(1, [*args, f"trainer.save_dir={tmp_path / 'one'}"])
    run_ranks(2, [*args, "actor.tp_size=2", f"trainer.save_dir={tmp_path / 'two'}"])
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for key in ("train/loss", "train/grad_norm"):
        assert [m[key] for m in two] == pytest.approx([m[key] for m in one], rel=1e-4)


@pytest.mark.parametrize("nproc", [2, 3])
def test_shared_memory_collectives_and_gather_equal_gloo(nproc):
    """FSDP's all-gathers and reduce-scatters on one host go through shared memory: what gloo computes;
    and weight syncs read the shards from shared memory: exactly what gloo gathers."""
    result = run_ranks(nproc, ["tests/e2e/scripts/shared_collectives.py"])
    assert "shared collectives OK" in result.stdout and "shared gather OK" in result.stdout


def test_float16_overflow_in_one_tp_shard_skips_the_step_on_every_rank(tiny_model_path):
    """float16 LoRA under tp=2, an inf in one rank's shard of a column-parallel lora_B: as on one process,
    the step is skipped and the loss scale halved, on both ranks (a rank that stepped alone would leave
    the tp-replicated lora_A, the optimizer's step count and the loss scale differing between ranks)."""
    result = run_ranks(2, ["tests/e2e/scripts/float16_overflow_on_one_rank.py", tiny_model_path])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["first_trained"].endswith("q_proj.lora_A.weight")  # replicated over tp
    assert report["ranks"] == [{"scale": 2.0**15, "stepped": False, "changed": False}] * 2


def assert_adapters_of_one_process(one: dict, two: dict) -> None:
    """The adapters of a tp=2 run (whole, and each rank's tp-replicated copies) equal one process's."""
    for name, value in one["full"].items():
        # float32 sums in another order, through Adam's steps: ~1e-6 apart.
        torch.testing.assert_close(two["full"][name], value, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    for rank, copies in enumerate(two["copies"]):
        for name, local in copies.items():
            if local.shape == one["full"][name].shape:  # replicated over tp (column-wise A, row-wise B)
                torch.testing.assert_close(local, one["full"][name], atol=1e-5, rtol=1e-4,
                                           msg=lambda m: f"rank {rank}'s {name}: {m}")


@pytest.fixture(scope="module")
def lora_dropout_runs(tiny_model_path, tmp_path_factory) -> tuple[dict, dict]:
    """One process and tp=2, each taking two steps from the start, then two more from a checkpoint that 2
    data-parallel ranks saved: three launches for both tests below."""
    script, folder = "tests/e2e/scripts/lora_dropout_steps.py", tmp_path_factory.mktemp("lora_dropout")
    run_ranks(2, [script, tiny_model_path, "-", "1", "save", str(folder / "ckpt")])
    run_ranks(1, [script, tiny_model_path, str(folder / "one.pt"), "1", "load", str(folder / "ckpt")])
    run_ranks(2, [script, tiny_model_path, str(folder / "two.pt"), "2", "load", str(folder / "ckpt")])
    return torch.load(folder / "one.pt"), torch.load(folder / "two.pt")


def test_lora_dropout_under_tp_equals_one_process(lora_dropout_runs):
    """Adapter dropout under tp=2 drops what one process drops: on column-parallel layers (q_proj, v_proj)
    the tp ranks share the input and drop the same features of it, so the replicated lora_A stays the same
    on both ranks; on a row-parallel one (o_proj) each drops its slice of the one-process mask. The
    adapters after two steps are the one-process ones."""
    one, two = lora_dropout_runs
    assert_adapters_of_one_process(one["fresh"], two["fresh"])


def test_lora_dropout_after_a_resume_under_tp_equals_one_process(lora_dropout_runs):
    """A checkpoint of 2 data-parallel ranks (whose random streams differ, as their data does) resumed
    under tp=2: both tp ranks continue the random stream of the group's first rank, so their dropout masks
    agree and the adapters equal those of one process resumed from the same checkpoint."""
    one, two = lora_dropout_runs
    assert_adapters_of_one_process(one["resumed"], two["resumed"])
