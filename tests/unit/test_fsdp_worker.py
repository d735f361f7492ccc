"""FSDPWorker on one CPU rank: what colocation moves off the device, and float16 training with a gradient scaler."""

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from RL2.batch import SequenceBatch
from RL2.config.schema import ModelConfig
from RL2.models.logps import packed_logps
from RL2.packing import pack, train_weights
from RL2.parallel import ParallelDims
from RL2.workers.fsdp import FSDPWorker


def worker(path: str, dtype: str = "float32", base_changes: bool = False, **overrides) -> FSDPWorker:
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"model_name": path, "dtype": dtype,
                                                               "optimizer": {"lr": 1e-3}} | overrides)
    return FSDPWorker(cfg, ParallelDims(1), torch.device("cpu"), total_steps=10, base_changes=base_changes)


def examples() -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, 1000, (n,), generator=generator).tolist(),
             "loss_mask": [0] * 3 + [1] * (n - 3)}
            for n in (20, 33, 9)]


def backward_nll(w: FSDPWorker, scale: float = 1.0) -> None:
    batch = SequenceBatch.from_examples(examples())
    for mb in pack(batch, 0, 1, 4096, train_weights(batch, "token")):
        w.backward(-(packed_logps(w.model, mb) * mb.loss_weights).sum() * scale)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def test_move_state_covers_parameters_gradients_and_optimizer_state(tiny_model_path, one_rank):
    """Every tensor colocation must take off the GPU moves: here to the meta device, which keeps none."""
    w = worker(tiny_model_path)
    backward_nll(w)
    w.optimizer_step()
    backward_nll(w)  # gradients present as well as Adam's moments and step counts
    tensors = lambda: ([local(p) for p in w.model.parameters()] + [local(p.grad) for p in w.model.parameters()]
                       + [local(v) for s in w.optimizer.state.values() for v in s.values() if torch.is_tensor(v)])
    n = len(tensors())
    assert n == 2 * len(list(w.model.parameters())) + 3 * len(w.optimizer.state)
    assert {t.device.type for t in tensors()} == {"cpu"}
    w.move_state(torch.device("meta"))
    assert {t.device.type for t in tensors()} == {"meta"}
    assert w.resident_bytes().keys() == {"meta"}


def test_micro_batch_metrics_are_summed_over_the_batch(tiny_model_path, one_rank):
    """Tensors (what losses return, summed on their device) and plain numbers alike, a metric that only some
    micro-batches report included; the loss's gradient reaches the model as before."""
    w = worker(tiny_model_path)
    batch = SequenceBatch.from_examples(examples())
    micro = pack(batch, 0, 1, 40, train_weights(batch, "token"))
    assert len(micro) > 1

    def loss_fn(mb):
        logps = packed_logps(w.model, mb)
        metrics = {"tokens": mb.loss_mask.sum(), "count": 1, "nll": -(logps * mb.loss_mask).sum()}
        return -(logps * mb.loss_weights).sum(), metrics | ({"long": 2.5} if mb.input_ids.shape[1] > 20 else {})

    expected = {"tokens": float(batch.tokens["loss_mask"].sum()), "count": float(len(micro)),
                "nll": sum(float(loss_fn(mb)[1]["nll"].detach()) for mb in micro),
                "long": 2.5 * sum(mb.input_ids.shape[1] > 20 for mb in micro)}
    totals = w.run_micro_batches(micro, loss_fn)
    assert totals == pytest.approx(expected, rel=1e-6)
    assert all(p.grad is not None for p in w.model.parameters() if p.requires_grad)


def test_offload_is_a_no_op_on_cpu(tiny_model_path, one_rank):
    w = worker(tiny_model_path)
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    w.offload()
    w.onload()
    assert all(torch.equal(before[k], v) for k, v in w.model.state_dict().items())
    assert not w.offloaded


def test_float16_trains_through_the_gradient_scaler(tiny_model_path, one_rank):
    """float16 compute: the loss is scaled up for backward and the gradients scaled back before clipping,
    so the gradient norm is float32's; a step with an infinite gradient is skipped and the scale lowered."""
    reference, half = worker(tiny_model_path, "float32"), worker(tiny_model_path, "float16")
    assert reference.scaler is None and half.scaler is not None
    backward_nll(reference)
    backward_nll(half)
    scale = half.scaler.get_scale()
    assert scale > 1.0
    for (name, p), q in zip(reference.model.named_parameters(), half.model.parameters()):
        # The scaled gradients: float32's times the scale, up to float16 round-off.
        error = (local(q.grad) / scale - local(p.grad)).norm() / local(p.grad).norm()
        assert error < 0.05, name
    norms = reference.optimizer_step()["grad_norm"], half.optimizer_step()["grad_norm"]
    assert norms[1] == pytest.approx(norms[0], rel=0.02)  # unscaled before clipping
    before = [local(p).clone() for p in half.model.parameters()]
    backward_nll(half, scale=float("inf"))
    half.optimizer_step()
    assert all(torch.equal(b, local(p)) for b, p in zip(before, half.model.parameters()))
    assert half.scaler.get_scale() == scale / 2
    assert "grad_scaler" in half.state_dict()


def test_a_step_with_a_gradient_that_is_not_finite_is_skipped_and_said(tiny_model_path, one_rank, capsys):
    w = worker(tiny_model_path)
    before = [local(p).clone() for p in w.model.parameters()]
    backward_nll(w, scale=float("nan"))
    assert torch.isnan(torch.tensor(w.optimizer_step()["grad_norm"]))
    assert all(torch.equal(b, local(p)) for b, p in zip(before, w.model.parameters()))
    assert "skipped optimizer step 1: the gradient norm is nan" in capsys.readouterr().out
    backward_nll(w)
    assert torch.isfinite(torch.tensor(w.optimizer_step()["grad_norm"]))
    assert any(not torch.equal(b, local(p)) for b, p in zip(before, w.model.parameters()))  # the next step trains


@pytest.mark.parametrize("base_changes", [True, False])
def test_a_lora_base_that_resets_change_keeps_every_update_of_the_adapters(tiny_model_path, one_rank, base_changes):
    """bf16 compute with LoRA: the base is stored in bf16 unless PPO's reference resets will merge
    the adapters into it; then it is float32, and a merge leaves the policy's weights W + s B A
    as they were, where a bf16 base rounds small adapter updates away."""
    from RL2.models.lora import adapter_modules, merge_into_base

    w = worker(tiny_model_path, "bfloat16", lora={"rank": 4, "alpha": 8.0}, base_changes=base_changes)
    modules = adapter_modules(w.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in modules:  # small learned updates, as a few steps at a low learning rate leave them
            b = local(module.lora_B.weight)
            b.copy_(1e-4 * torch.randn(b.shape, generator=generator))

    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach().double()  # noqa: E731
    updates = [m.scaling * full(m.lora_B.weight) @ full(m.lora_A.weight) for m in modules]
    before = [full(m.base_layer.weight) + update for m, update in zip(modules, updates)]
    merge_into_base(w.model, 1.0)  # the whole adapter into the base; B becomes 0
    after = [full(m.base_layer.weight) + m.scaling * full(m.lora_B.weight) @ full(m.lora_A.weight) for m in modules]
    change = max(((a - b).norm() / update.norm()).item() for a, b, update in zip(after, before, updates))
    dtypes = {local(m.base_layer.weight).dtype for m in modules}
    if base_changes:
        assert dtypes == {torch.float32} and change < 1e-3  # float32 rounding of the merge only
    else:
        assert dtypes == {torch.bfloat16} and change > 0.1  # most of each update rounded away


def test_capped_attention_scores_keep_whole_rows_and_refuse_context_parallelism(tmp_path, one_rank):
    """Gemma 2's capped scores are applied by the whole-row kernels only: no shared prefixes, no cp."""
    from types import SimpleNamespace

    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                          num_attention_heads=4, num_key_value_heads=2, attn_logit_softcapping=50.0)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    w = worker(str(tmp_path), share_prefixes=True)
    assert not w.model.parallel_layout.share_prefixes
    two_way_cp = SimpleNamespace(dims=ParallelDims(2, cp=2), cfg=SimpleNamespace(tp_size=1, cp_size=2, ddp_size=1),
                                 _config_name=lambda: "actor.model_name=gemma-2")
    with pytest.raises(ValueError, match=r"actor.model_name=gemma-2 caps its attention scores "
                                         r"\(attn_logit_softcapping=50.0\).*set cp_size=1"):
        FSDPWorker._check_layout(two_way_cp, config)


def test_a_critic_keeps_the_trained_head_of_the_checkpoint_it_starts_from(tiny_model_path, one_rank, tmp_path):
    """PPO's critic starts its head at zero on a causal LM, but a checkpoint saved with a head (a reward model
    or a critic RL2 exported; InstructGPT starts the value function from the reward model) keeps it: the
    values are then that checkpoint's own forward."""
    from transformers import AutoModelForTokenClassification

    from RL2.batch import RolloutBatch
    from RL2.config.ppo_schema import CriticConfig
    from RL2.workers.critic import Critic

    trained = AutoModelForTokenClassification.from_pretrained(tiny_model_path, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        trained.score.weight.copy_(torch.randn(trained.score.weight.shape, generator=torch.Generator().manual_seed(0)))
        trained.score.bias.fill_(0.5)
    trained.save_pretrained(tmp_path / "critic")

    def critic_values(path) -> torch.Tensor:
        cfg = OmegaConf.merge(OmegaConf.structured(CriticConfig), {"model_name": str(path), "dtype": "float32"})
        return Critic(cfg, ParallelDims(1), torch.device("cpu"), total_steps=1).values(batch)

    example = {"input_ids": list(range(3, 23)), "loss_mask": [0] * 5 + [1] * 15}
    batch = RolloutBatch.single_turn([example], [0])
    with torch.no_grad():  # the value before each label: the head at the position that predicts it
        direct = trained(input_ids=torch.tensor([example["input_ids"][:-1]])).logits[0, :, 0]
    assert direct.abs().min() > 0
    torch.testing.assert_close(critic_values(tmp_path / "critic"), direct, atol=1e-5, rtol=1e-4)
    assert torch.count_nonzero(critic_values(tiny_model_path)) == 0  # a causal LM's new head starts at zero


def test_a_reward_model_scores_each_trajectory_at_its_last_token(tiny_model_path, one_rank, tmp_path):
    """A trajectory's score is the reward model's head at the last position of its last sequence (a
    trajectory of two sequences is scored on the second), and 0 for a trajectory with no sequence."""
    from transformers import AutoModelForTokenClassification

    from RL2.config.ppo_schema import CriticConfig
    from RL2.workers.critic import RewardModel

    trained = AutoModelForTokenClassification.from_pretrained(tiny_model_path, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        trained.score.weight.copy_(torch.randn(trained.score.weight.shape, generator=torch.Generator().manual_seed(1)))
    trained.save_pretrained(tmp_path / "rm")

    sequences = [list(range(3, 20)), list(range(40, 70)), list(range(100, 111))]
    batch = SequenceBatch(input_ids=sequences, tokens={"loss_mask": torch.ones(sum(len(s) - 1 for s in sequences))},
                          sample_ids=torch.tensor([0, 0, 2]), n_samples=4)
    cfg = OmegaConf.merge(OmegaConf.structured(CriticConfig), {"model_name": tiny_model_path, "dtype": "float32",
                                                                 "max_length_per_device": 32})
    scores = RewardModel(cfg, ParallelDims(1), torch.device("cpu"), str(tmp_path / "rm")).scores(batch)

    with torch.no_grad():  # the last label's position: the sequence without its last token
        direct = [trained(input_ids=torch.tensor([ids[:-1]])).logits[0, -1, 0].item() for ids in sequences]
    assert len({round(x, 4) for x in direct}) == 3
    torch.testing.assert_close(scores, torch.tensor([direct[1], 0.0, direct[2], 0.0]), atol=1e-5, rtol=1e-4)


def test_a_resume_with_another_learning_rate_says_the_checkpoints_rate_goes_on(tiny_model_path, one_rank, capsys):
    saved = worker(tiny_model_path, optimizer={"lr": 1e-3})
    backward_nll(saved)
    saved.optimizer_step()
    state = saved.state_dict()
    resumed = worker(tiny_model_path, optimizer={"lr": 1e-5})
    resumed.load_state_dict(state)
    assert resumed.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]
    assert ("resuming with the checkpoint's learning rates [0.001], not [1e-05] from optimizer.lr"
            in capsys.readouterr().out)
    worker(tiny_model_path, optimizer={"lr": 1e-3}).load_state_dict(state)
    assert "resuming with" not in capsys.readouterr().out
