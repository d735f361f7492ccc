"""Weight pushes of a mixture-of-experts policy on a GPU (`RL2.engine.checkpoint_layout`; on CPU:
tests/unit/test_checkpoint_layout.py and the MoE server tests of tests/e2e/test_sglang.py).

Without SGLang: the policy's CUDA tensors, mapped to the checkpoint's layout by the disk push, load as
the policy. With SGLang (RL2_SGLANG_PYTHON names a Python that has it): a server launched on this GPU
as RL2 launches it (colocated, memory saver, tensor sync through CUDA IPC) releases and resumes its
weights, receives the policy, serves its log-probabilities, and a push without the experts stops
naming them; the seconds of a push with and without the check are printed.
"""

import asyncio
import os
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from RL2.engine.checkpoint_layout import CheckpointLayout
from RL2.engine.sglang.weight_transfer import buckets, write_hf_folder
from tests.helpers.tiny import make_tiny_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = torch.device("cuda", 0)
SGLANG_PYTHON = os.environ.get("RL2_SGLANG_PYTHON")
PROMPT = [1, 9690, 198, 2683, 359, 253, 42, 77]


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return make_tiny_moe(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def trained(path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model with every weight moved (a policy after some updates), its final norm sharpened so that
    its next-token distributions are peaked."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 0.5 * torch.randn_like(param))
        model.model.norm.weight.mul_(10.0)
    return model.to(DEVICE, dtype)


@torch.no_grad()
def logps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + tokens], device=DEVICE)).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device=DEVICE)[:, None])[:, 0].cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_tensors_pushed_to_a_folder_load_as_the_policy(moe_path, tmp_path, dtype):
    """The disk push's steps on the policy's CUDA parameters (mapped, in 64 kB buckets, written): transformers
    loads the folder with the same weights, expert by expert (and, in float32, the same logits)."""
    policy = trained(moe_path, dtype)
    mapped = CheckpointLayout.from_folder(moe_path).to_checkpoint(policy.named_parameters())
    write_hf_folder(buckets(mapped, 2**16), tmp_path / "step1", moe_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "step1", dtype=dtype).to(DEVICE).eval()
    for (name, expected), (_, got) in zip(policy.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(expected, got), name
    if dtype == torch.float32:
        with torch.no_grad():
            ids = torch.tensor([PROMPT], device=DEVICE)
            torch.testing.assert_close(loaded(ids).logits, policy(ids).logits, rtol=0, atol=1e-4)


@pytest.mark.skipif(not SGLANG_PYTHON, reason="RL2_SGLANG_PYTHON is not set (a Python with sglang 0.5.23)")
def test_a_launched_gpu_server_serves_the_pushed_experts(moe_path, tmp_path, one_rank):
    # The trainer's modules that reach SGLang need omegaconf, which a GPU machine without SGLang may lack.
    from RL2.engine.protocol import EngineError
    from RL2.engine.sglang.engine import SGLangEngine
    from RL2.engine.sglang.http_client import HTTPEngineClient

    cfg = SimpleNamespace(server_args={"mem_fraction_static": 0.5}, server_python=SGLANG_PYTHON, server_env={},
                          server_log_dir=str(tmp_path / "logs"), server_timeout=900.0, weight_sync="auto",
                          weights_dir=str(tmp_path), weight_bucket_mb=512.0, request_timeout=600.0,
                          check_weight_sync=True)
    engine = SGLangEngine.launch(cfg, moe_path, torch.bfloat16, DEVICE, seed=0)
    try:
        assert engine.weight_sync == "tensor" and engine.releases_memory
        policy = trained(moe_path, torch.bfloat16)
        initial = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.bfloat16).to(DEVICE).eval()

        def push(named_tensors, version: str) -> float:
            engine.release_memory(["weights", "kv_cache", "cuda_graph"])  # as between two rollouts
            engine.resume_memory(["weights"])
            began = time.perf_counter()
            try:
                engine.update_weights(named_tensors, weight_version=version)
            finally:
                engine.resume_memory(["kv_cache", "cuda_graph"])
            return time.perf_counter() - began

        checked = push(policy.named_parameters(), "step1")
        response = asyncio.run(HTTPEngineClient(engine.urls, api_key=engine.api_key).generate({
            "input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}}))
        tokens = response["output_ids"]
        served = torch.tensor([lp for lp, _, _ in response["meta_info"]["output_token_logprobs"]])
        gap = (served - logps(policy, PROMPT, tokens)).abs().max().item()
        gap_to_initial = (served - logps(initial, PROMPT, tokens)).abs().max().item()
        print(f"served vs policy log-probs: max gap {gap:.4f} (vs the initial model's {gap_to_initial:.4f})")
        assert gap < 0.1 < gap_to_initial

        no_experts = [(name, p) for name, p in policy.named_parameters() if ".experts." not in name]
        with pytest.raises(EngineError, match=r"did not write 4 parameters.*layers\.0\.mlp\.experts\.w13_weight"):
            push(no_experts, "partial")

        engine.check_weights = False
        unchecked = push(policy.named_parameters(), "step2")
        print(f"push of a tiny Qwen3-MoE on {torch.cuda.get_device_name(DEVICE)}: {checked:.3f} s checked, "
              f"{unchecked:.3f} s unchecked")
    finally:
        engine.shutdown()
