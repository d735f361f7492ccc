"""One NCCL rank of the FSDP2 worker on CUDA against a plain Hugging Face model on the same GPU.

Loading, packed forward and log-probs, backward, clipping and an AdamW step, moving the state off the
GPU and back (the colocation hook), a checkpoint round trip and the exported folder; then bf16 and
float16 compute (the latter through the gradient scaler); activation checkpointing of every second layer;
a LoRA policy's weight sync from the CPU; the offloaded state in page-locked buffers reused by every
offload, and the optimizer state kept on the CPU between steps.
"""

import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from RL2.batch import SequenceBatch
from RL2.models.logps import packed_logps
from RL2.models.lora import LoRALinear, adapter_modules
from RL2.native.pinned_host import SMALL_BYTES
from RL2.packing import pack, train_weights
from RL2.parallel import ParallelDims
from RL2.workers.fsdp import FSDPWorker, full_tensors
from tests.gpu.cuda_models import model_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LR = 1e-3
EPS = 1e-3  # Adam with a tiny eps moves near-zero gradients by ~lr whatever their round-off
DEVICE = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def nccl_rank():
    torch.cuda.set_device(DEVICE)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def examples(vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, vocab, (n,), generator=generator).tolist(),
             "loss_mask": [0] * (n // 3) + [1] * (n - n // 3)} for n in (700, 65, 300, 1500, 12)]


def worker(path: str, dtype: str = "float32", **overrides) -> FSDPWorker:
    cfg = model_config(path, dtype, **overrides)
    cfg.optimizer.lr, cfg.optimizer.eps = LR, EPS
    return FSDPWorker(cfg, ParallelDims(1, device_type="cuda"), DEVICE, total_steps=10)


def local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def rl2_step(w: FSDPWorker, batch: list[dict]) -> tuple[list[torch.Tensor], float]:
    """Per-sequence log-probs of a packed pass, backward of the token-mean NLL, one optimizer step."""
    logps = {}
    sequences = SequenceBatch.from_examples(batch)
    for mb in pack(sequences, 0, 1, 4096, train_weights(sequences, "token")):
        mb = mb.to(DEVICE)
        values = packed_logps(w.model, mb)
        w.backward(-(values * mb.loss_weights).sum())
        for index, chunk in zip(mb.sequence_ids, mb.unpack(values.detach())):
            logps[index] = chunk.float()
    grad_norm = w.optimizer_step()["grad_norm"]
    return [logps[i] for i in range(len(batch))], grad_norm


class Reference:
    """The same step with the Hugging Face model in float32, one sequence at a time, no packing."""

    def __init__(self, path: str):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="sdpa").to(DEVICE)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)

    def step(self, batch: list[dict]) -> tuple[list[torch.Tensor], float, dict]:
        n_trained = sum(sum(ex["loss_mask"][1:]) for ex in batch)
        logps = []
        for ex in batch:
            ids = torch.tensor([ex["input_ids"]], device=DEVICE)
            logits = self.model(input_ids=ids[:, :-1]).logits.float()
            values = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[0, :, 0]
            mask = torch.tensor(ex["loss_mask"][1:], device=DEVICE, dtype=torch.float32)
            (-(values * mask).sum() / n_trained).backward()
            logps.append((values * mask).detach())  # RL2 computes logits at trained tokens only (0.0 elsewhere)
        grads = {name: p.grad.clone() for name, p in self.model.named_parameters()}
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0).item()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return logps, grad_norm, grads


def assert_params_equal(w: FSDPWorker, reference: Reference, atol: float) -> None:
    expected = dict(reference.model.named_parameters())
    for name, param in w.model.named_parameters():
        torch.testing.assert_close(local(param), expected[name].detach(), atol=atol, rtol=1e-4, msg=name)


def test_float32_worker_equals_hugging_face(model_path, tokenizer, nccl_rank, tmp_path):
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    w = worker(model_path)
    params = list(w.model.parameters())
    param_bytes = sum(local(p).numel() * 4 for p in params)
    # Loaded from rank 0's CPU copy one tensor at a time: no second full copy on the GPU.
    assert torch.cuda.max_memory_allocated() - before <= param_bytes + 2 * max(p.numel() * 4 for p in params) + 2**24
    reference = Reference(model_path)
    batch = examples(len(tokenizer))

    # Forward, log-probs, backward, clipping, AdamW.
    logps, grad_norm = rl2_step(w, batch)
    ref_logps, ref_grad_norm, _ = reference.step(batch)
    for ours, theirs in zip(logps, ref_logps):
        torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    assert grad_norm == pytest.approx(ref_grad_norm, rel=1e-3)
    assert_params_equal(w, reference, atol=1e-6)

    # Off the GPU and back, as around a colocated rollout: the memory is returned to the driver.
    allocated, free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    state_bytes = w.resident_bytes()["cuda"]
    w.offload()
    assert "cuda" not in w.resident_bytes()
    assert allocated - torch.cuda.memory_allocated() >= state_bytes
    assert torch.cuda.mem_get_info()[0] - free >= 0.8 * state_bytes  # given back to the driver (empty_cache)
    w.onload()
    assert w.resident_bytes().keys() == {"cuda"} and w.resident_bytes()["cuda"] == state_bytes
    logps, grad_norm = rl2_step(w, batch)
    _, ref_grad_norm, _ = reference.step(batch)
    assert grad_norm == pytest.approx(ref_grad_norm, rel=1e-3)
    assert_params_equal(w, reference, atol=5e-6)

    # Checkpoint round trip: a fresh worker restored from it takes the same next step.
    dcp.save({"actor": w}, checkpoint_id=str(tmp_path / "ckpt"))
    restored = worker(model_path)
    dcp.load({"actor": restored}, checkpoint_id=str(tmp_path / "ckpt"))
    for a, b in zip(w.model.parameters(), restored.model.parameters()):
        assert torch.equal(local(a), local(b))
    rl2_step(w, batch)
    rl2_step(restored, batch)
    for a, b in zip(w.model.parameters(), restored.model.parameters()):
        torch.testing.assert_close(local(a), local(b), atol=1e-6, rtol=0)  # attention backward may sum in any order

    # The exported folder loads with plain transformers.
    w.save_hf(str(tmp_path / "export"), tokenizer)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    for name, param in w.model.named_parameters():
        assert torch.equal(exported.get_parameter(name), local(param).cpu()), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_worker_trains(model_path, tokenizer, nccl_rank, dtype):
    """bf16 and fp16 compute over float32 master weights: log-probs near float32's, and the step's
    gradient norm is float32's (fp16 unscales through its gradient scaler before clipping)."""
    batch = examples(len(tokenizer))
    full = worker(model_path)
    half = worker(model_path, dtype)
    assert (half.scaler is not None) == (dtype == "float16")
    logps, grad_norm = rl2_step(half, batch)
    ref_logps, ref_grad_norm = rl2_step(full, batch)
    for ours, theirs in zip(logps, ref_logps):
        assert (ours - theirs).abs().mean() < 0.05
    assert grad_norm == pytest.approx(ref_grad_norm, rel=0.05)


def test_checkpointing_every_second_layer_takes_the_same_step(model_path, tokenizer, nccl_rank):
    """Activation checkpointing on CUDA through this transformers version's switch, every second decoder
    layer recomputed in the backward: the log-probs, gradient norm and step of keeping every activation."""
    batch = examples(len(tokenizer))
    checkpointed = worker(model_path, enable_gradient_checkpointing=True, checkpoint_every_n_layers=2)
    plain = worker(model_path)
    layers = checkpointed.model.model.layers
    assert [layer.gradient_checkpointing for layer in layers] == [i % 2 == 0 for i in range(len(layers))]
    logps, grad_norm = rl2_step(checkpointed, batch)
    ref_logps, ref_grad_norm = rl2_step(plain, batch)
    for ours, theirs in zip(logps, ref_logps):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert grad_norm == pytest.approx(ref_grad_norm, rel=1e-4)
    for ours, theirs in zip(checkpointed.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(local(ours), local(theirs), atol=1e-6, rtol=0)


def large_state(w: FSDPWorker) -> list[torch.Tensor]:
    """The local tensors of the parameters and Adam moments large enough for page-locked buffers."""
    tensors = [local(p) for p in w.model.parameters()]
    tensors += [local(v) for state in w.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return [t for t in tensors if t.numel() * t.element_size() >= SMALL_BYTES]


def test_offloaded_state_sits_in_locked_pages_reused_by_every_offload(model_path, tokenizer, nccl_rank):
    batch = examples(len(tokenizer))
    w = worker(model_path)
    rl2_step(w, batch)
    resident = [t.clone() for t in large_state(w)]
    w.offload()
    first = large_state(w)
    assert len(first) == 3  # the tied embedding and its two moments
    assert all(t.device.type == "cpu" and t.is_pinned() for t in first)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(resident, first))
    w.onload()
    assert all(torch.equal(a, b) for a, b in zip(resident, large_state(w)))
    rl2_step(w, batch)
    w.offload()
    assert [t.data_ptr() for t in large_state(w)] == [t.data_ptr() for t in first]  # the same buffers
    w.onload()


def test_pageable_offload_when_asked(model_path, tokenizer, nccl_rank, monkeypatch):
    monkeypatch.setenv("RL2_PINNED_OFFLOAD", "0")
    batch = examples(len(tokenizer))
    w = worker(model_path)
    rl2_step(w, batch)
    w.offload()
    assert w.host_copies is None and not any(t.is_pinned() for t in large_state(w))
    w.onload()
    rl2_step(w, batch)


def test_optimizer_state_on_the_cpu_between_steps_takes_the_same_steps(model_path, tokenizer, nccl_rank):
    """`offload_optimizer`: Adam's moments come to the GPU for each step and go back to locked pages."""
    batch = examples(len(tokenizer))
    kept, offloaded = worker(model_path), worker(model_path, offload_optimizer=True)
    for _ in range(2):
        rl2_step(kept, batch)
        rl2_step(offloaded, batch)
        moments = [local(v) for s in offloaded.optimizer.state.values() for v in s.values() if v.dim() > 0]
        assert moments and all(m.device.type == "cpu" for m in moments)
        assert all(m.is_pinned() for m in moments if m.numel() * m.element_size() >= SMALL_BYTES)
    for ours, theirs in zip(offloaded.model.parameters(), kept.model.parameters()):
        torch.testing.assert_close(local(ours), local(theirs), atol=1e-6, rtol=0)  # attention backward's sums


def test_lora_sync_streams_the_offloaded_base(model_path, nccl_rank):
    """A LoRA policy in a colocated sync: its parameters wait on the CPU (offload) and come to the GPU one
    at a time to be gathered and merged; the engine gets W + (alpha / r) B A under the base names, the
    same tensors as from the resident model."""
    targets = ["q_proj", "v_proj", "down_proj"]
    cfg = model_config(model_path, "bfloat16", lora=SimpleNamespace(rank=8, alpha=16.0, dropout=0.0,
                                                                     target_modules=targets))
    w = FSDPWorker(cfg, ParallelDims(1, device_type="cuda"), DEVICE, total_steps=10)
    with torch.no_grad():
        for module in adapter_modules(w.model):
            local(module.lora_B.weight).normal_()
    assert {p.dtype for p in w.model.parameters() if not p.requires_grad} == {torch.bfloat16}  # the frozen base
    assert {p.dtype for p in w.model.parameters() if p.requires_grad} == {torch.float32}  # the adapters
    resident = dict(w.engine_weights(full_tensors(w.model, torch.bfloat16)))
    w.offload()
    assert all(local(p).device.type == "cpu" for p in w.model.parameters())
    streamed = dict(w.engine_weights(full_tensors(w.model, torch.bfloat16)))
    w.onload()
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).state_dict()
    assert streamed.keys() == {name for name, _ in AutoModelForCausalLM.from_pretrained(model_path).named_parameters()}
    adapters = {name: module for name, module in w.model.named_modules() if isinstance(module, LoRALinear)}
    for name, tensor in streamed.items():
        assert tensor.device.type == "cuda" and torch.equal(tensor, resident[name]), name
        module = adapters.get(name.removesuffix(".weight"))
        expected = base[name].cuda().float()
        if module is not None:
            a, b = local(module.lora_A.weight).float(), local(module.lora_B.weight).float()
            expected = expected + 2.0 * b @ a
        torch.testing.assert_close(tensor.float(), expected, atol=1e-2, rtol=1e-2, msg=lambda m, n=name: f"{n}: {m}")
