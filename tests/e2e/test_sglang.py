"""SGLang as the rollout engine: config checks, the weight folder writer, and a real SGLang server on CPU.

RL2_SGLANG_PYTHON names a Python with sglang installed: a virtual environment of its own (SGLang pins its
own torch), or RL2's own where both share one, as in .ci/run's SGLang step (docs/gpus.md's one-environment
install). Servers run from it and the tests talk HTTP, as the trainer does. SGLang's CPU path imports one vLLM op it
never calls; the stub in tests/sglang_stub is put on the servers' PYTHONPATH.

Expectations come from the Hugging Face model itself in float32 (its greedy tokens and its
log-softmax), which SGLang in float32 on CPU reproduces.
"""

import asyncio
import copy
import gc
import importlib.util
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from RL2.config.errors import ConfigError
from RL2.config.server_args import check_server_args
from RL2.engine.embedded.engine import EmbeddedEngine
from RL2.engine.protocol import EngineError
from RL2.engine.sglang.engine import (
    SGLangEngine,
    _launched_weight_sync,
    control_request,
    resolve_engine,
    returns_original_logprobs,
    server_urls,
    server_version,
)
from RL2.engine.sglang.http_client import HTTPEngineClient
from RL2.engine.sglang.server import SGLangServer, server_command
from RL2.engine.sglang.weight_transfer import (
    FLATTENED_BUCKET_VERSIONS,
    buckets,
    flatten_bucket,
    serialize_flat_bucket,
    write_hf_folder,
)
from RL2.rollout.loop import action_text
from tests.helpers import SGLANG_STUB
from tests.helpers.launch import read_metrics, run_ranks
from tests.helpers.sglang import SGLANG_PYTHON, needs_sglang
from tests.helpers.tiny import make_tiny_moe

STUB = SGLANG_STUB
# As RL2 launches its servers: log-probabilities of the distribution at the sampling temperature (SGLang's default).
SERVER_ENV = {"PYTHONPATH": str(STUB), "SGLANG_RETURN_ORIGINAL_LOGPROB": "0"}
CPU_ARGS = {"device": "cpu", "dtype": "float32", "max_total_tokens": 8192, "sleep_on_idle": True}

# ---- without a server --------------------------------------------------------------------------


def test_server_args_become_flags():
    args = check_server_args({"tp-size": 2, "enable_memory_saver": True, "disable_radix_cache": False,
                              "cuda_graph_bs": [1, 2], "host": "0.0.0.0"})
    assert args == {"tp_size": 2, "enable_memory_saver": True, "disable_radix_cache": False,
                    "cuda_graph_bs": [1, 2], "host": "0.0.0.0"}
    command = server_command("py", "/m", 1234, args)
    assert command == ["py", "-m", "sglang.launch_server", "--model-path", "/m", "--port", "1234", "--tp-size", "2",
                       "--enable-memory-saver", "--cuda-graph-bs", "1", "2", "--host", "0.0.0.0"]


@pytest.mark.parametrize("bad, words", [
    ({"port": 1}, "rollout.server_args.port"),
    ({"model-path": "x"}, "set by RL2"),
    ({"--tp": 1}, "not a flag name"),
    ({"tp_size": None}, "must be a string"),
    ({"x": {"a": 1}}, "must be a string"),
])
def test_bad_server_args_name_the_key(bad, words):
    with pytest.raises(ConfigError, match=words):
        check_server_args(bad)


def test_engine_choice():
    cpu, cfg = torch.device("cpu"), lambda **kw: SimpleNamespace(**({"engine": "auto", "server_url": None,
                                                                      "server_python": None} | kw))
    assert resolve_engine(cfg(), cpu) == "embedded"
    assert resolve_engine(cfg(engine="sglang"), cpu) == "sglang"
    assert resolve_engine(cfg(server_url="http://h:1"), cpu) == "sglang"
    assert server_urls("http://a:1/, http://b:2") == ["http://a:1", "http://b:2"]
    assert server_urls(["http://a:1"]) == ["http://a:1"]
    with pytest.raises(ConfigError, match="rollout.server_url"):
        server_urls("a:1")


def test_tensor_sync_needs_a_server_version_whose_format_rl2_writes():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    supported = set(FLATTENED_BUCKET_VERSIONS)
    assert _launched_weight_sync("auto", cuda, supported) == "tensor"
    assert _launched_weight_sync("auto", cuda, {"0.4.0"}) == "disk"
    assert _launched_weight_sync("auto", cpu, supported) == "disk"
    assert _launched_weight_sync("tensor", cpu, supported) == "tensor"  # by value: SGLang on CPU
    with pytest.raises(ConfigError, match=r"run version 0\.4\.0.*rollout\.weight_sync=disk"):
        _launched_weight_sync("tensor", cuda, {"0.4.0"})
    with pytest.raises(ConfigError, match="unknown"):
        _launched_weight_sync("tensor", cuda, set())


def test_a_tensor_push_lets_each_bucket_of_full_tensors_go_before_sending_it(tiny_model_path):
    """While a bucket's flat copy is sent, the full tensors gathered for it are freed: at most the flat copy
    and the next bucket's first tensor (already gathered to know the bucket was full) are held."""
    engine = SGLangEngine(["http://unused:1"], [], "tensor", 4096, tiny_model_path)  # controls no server
    handed = []  # a weak reference to every full tensor handed to the push, in order
    held_while_sending = []

    def gathered():
        for i in range(7):  # 2 kB each: buckets of two
            tensor = torch.randn(512)
            handed.append(weakref.ref(tensor))
            yield f"w{i}", tensor
            del tensor

    def control(endpoint, payload):
        if endpoint == "/update_weights_from_tensor":
            gc.collect()
            held_while_sending.append([i for i, ref in enumerate(handed[:-1]) if ref() is not None])

    engine._control_all = control
    engine._push_tensors(gathered(), "v1")
    assert len(held_while_sending) == 4 and held_while_sending[:3] == [[], [], []], held_while_sending


def test_a_gpu_server_without_the_memory_saver_needs_its_share_set(tiny_model_path):
    """enable_memory_saver=false on a GPU: the server could not release RL2's 85% of the GPU while the trainer
    trains beside it. Refused at launch, before any process group or server is touched, unless
    mem_fraction_static says how much it may keep."""
    cfg = lambda **args: SimpleNamespace(server_args=args, server_python=sys.executable, server_env={})
    with pytest.raises(ConfigError, match=r"enable_memory_saver=false.*mem_fraction_static=0\.85.*set "
                                          r"rollout\.server_args\.mem_fraction_static"):
        SGLangEngine.launch(cfg(enable_memory_saver=False), tiny_model_path, torch.float32, torch.device("cuda"), 0)
    # Sized by the user, or on the CPU (never colocated): past the check, to the process group, absent here.
    for args, device in (({"enable_memory_saver": False, "mem_fraction_static": 0.3}, "cuda"),
                         ({"enable_memory_saver": False}, "cpu")):
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            SGLangEngine.launch(cfg(**args), tiny_model_path, torch.float32, torch.device(device), 0)


@needs_sglang
def test_bucket_payload_is_read_by_sglangs_own_classes(tmp_path):
    """A bucket of mixed dtypes, serialized by RL2 without sglang, deserialized in the SGLang environment
    by its `MultiprocessingSerializer` (whose unpickler admits only listed globals) and rebuilt with
    `FlattenedTensorBucket` exactly as `/update_weights_from_tensor` does."""
    tensors = [("a.weight", torch.randn(3, 5)), ("b.bias", torch.randn(7, dtype=torch.bfloat16)),
               ("c.index", torch.arange(5)), ("d.weight", torch.randn(2, 2, 2, dtype=torch.float16))]
    (tmp_path / "payload.txt").write_text(serialize_flat_bucket(*flatten_bucket(tensors)))
    reader = """
import sys, torch
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
data = MultiprocessingSerializer.deserialize(open(sys.argv[1]).read())
metadata = [FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                    end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata)
torch.save({name: t.clone() for name, t in bucket.reconstruct_tensors()}, sys.argv[2])  # views of one buffer
"""
    subprocess.run([SGLANG_PYTHON, "-c", reader, str(tmp_path / "payload.txt"), str(tmp_path / "rebuilt.pt")],
                   check=True, capture_output=True, timeout=300)
    rebuilt = torch.load(tmp_path / "rebuilt.pt")
    assert list(rebuilt) == [name for name, _ in tensors]
    for name, tensor in tensors:
        assert rebuilt[name].dtype == tensor.dtype and torch.equal(rebuilt[name], tensor), name


def test_weight_folder_round_trip(tiny_model_path, tmp_path):
    """Buckets of 64 kB become several shards of a folder that transformers loads with the same weights."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    named = list(model.named_parameters())
    parts = list(buckets(named, 2**16))
    assert len(parts) > 2 and [name for part in parts for name, _ in part] == [name for name, _ in named]
    assert all(sum(t.numel() * 4 for _, t in part) <= 2**16 or len(part) == 1 for part in parts)
    folder = write_hf_folder(parts, tmp_path / "step1", tiny_model_path)
    assert not (tmp_path / ".step1.tmp").exists()
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for (name, expected), (_, got) in zip(named, loaded.named_parameters()):
        assert torch.equal(expected, got), name
    assert len(list(folder.glob("*.safetensors"))) == len(parts)
    assert set(load_file(folder / "model-00001.safetensors")) == {name for name, _ in parts[0]}


def test_weight_folder_of_no_tensors_is_refused_and_leaves_nothing(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="no tensors to write"):
        write_hf_folder([[]], tmp_path / "step1", tiny_model_path)  # a bucket, but nothing in it
    assert list(tmp_path.iterdir()) == []


# ---- a real SGLang server on CPU ---------------------------------------------------------------


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens (EOS ignored) and their log-probabilities, one full forward per token."""
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(logp.argmax())
            ids.append(token)
            logps.append(float(logp[token]))
    return ids[len(prompt):], logps


def model_logps(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """The log-probability of each output token after the prompt and the tokens before it, under the
    model's own logits divided by `temperature`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, -1)
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def generate(url: str, prompts: list[list[int]], **sampling) -> list[dict]:
    client = HTTPEngineClient([url])

    async def main():
        params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True} | sampling
        return await asyncio.gather(*(client.generate({"input_ids": p, "sampling_params": params,
                                                       "return_logprob": True}) for p in prompts))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    texts = ["What is 12 + 7?", "Name a colour.", "Once upon a time", "def f(x):"]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return [tok.encode(chat, add_special_tokens=False) for chat in chats]


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(tiny_model_path):
    """One server for the module (~45 s to start on CPU)."""
    server = SGLangServer(SGLANG_PYTHON, tiny_model_path, CPU_ARGS, SERVER_ENV).start()
    try:
        server.wait_ready(timeout=600)
        yield server
    finally:
        server.shutdown()
    assert not server.alive()
    # SGLang's load-snapshot file, which SGLang itself never unlinks, was found and is gone.
    assert server.shm_files and not any(os.path.exists(path) for path in server.shm_files), server.shm_files


@needs_sglang
def test_greedy_equals_hf_greedy(server, hf_model, prompts):
    responses = generate(server.url, prompts)
    for prompt, response in zip(prompts, responses):
        expected_ids, expected_logps = hf_greedy(hf_model, prompt, 16)
        meta = response["meta_info"]
        assert response["output_ids"] == expected_ids
        assert [token for _, token, _ in meta["output_token_logprobs"]] == expected_ids
        assert [logp for logp, _, _ in meta["output_token_logprobs"]] == pytest.approx(expected_logps, abs=1e-4)
        assert meta["finish_reason"]["type"] == "length"
        assert meta["completion_tokens"] == 16 and meta["prompt_tokens"] == len(prompt)


@needs_sglang
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_model_log_softmax(server, hf_model, prompts, temperature):
    """log softmax(logits / T) at the sampling temperature T, the policy the trainer trains, as the trainer
    and the embedded engine compute them: SGLang's default, which RL2's servers keep."""
    responses = generate(server.url, prompts * 2, temperature=temperature, max_new_tokens=24)
    outputs = [r["output_ids"] for r in responses]
    assert len({tuple(o) for o in outputs}) > 1  # really sampled
    for prompt, response in zip(prompts * 2, responses):
        tokens = [token for _, token, _ in response["meta_info"]["output_token_logprobs"]]
        logps = [logp for logp, _, _ in response["meta_info"]["output_token_logprobs"]]
        assert tokens == response["output_ids"]
        assert logps == pytest.approx(model_logps(hf_model, prompt, tokens, temperature), abs=1e-3)


def first_stop_index(tok, output: list[int], stop: dict) -> int:
    """How many of `output` a request with `stop` samples, found by decoding every prefix."""
    strings = [stop["stop"]] if isinstance(stop.get("stop"), str) else stop.get("stop", [])
    for k in range(1, len(output) + 1):
        if output[k - 1] in stop.get("stop_token_ids", []) or any(s in tok.decode(output[:k]) for s in strings):
            return k
    return len(output)


@needs_sglang
def test_stops_end_requests_alike_on_both_engines(server, hf_model, tok):
    """Stop strings (one completed inside a token), a single stop string and a stop token: SGLang and the
    embedded engine sample the same tokens, stop at the same one with the same finish reason, and the
    action the environment gets ends with the stop string."""
    cases = [("Once upon a time", {"stop": ["e ti", "never written"]}), ("def f(x):", {"stop": "):)"}),
             ("12 + 7 =", {"stop_token_ids": [tok.encode(" =", add_special_tokens=False)[0]]})]
    embedded = EmbeddedEngine(copy.deepcopy(hf_model), tok)
    client = HTTPEngineClient([server.url])

    async def both(payload: dict) -> list[dict]:
        return [await client.generate(copy.deepcopy(payload)), await embedded.generate(copy.deepcopy(payload))]

    for text, stop in cases:
        prompt = tok.encode(text, add_special_tokens=False)
        free, _ = hf_greedy(hf_model, prompt, 16)
        n = first_stop_index(tok, free, stop)
        assert n < 16, f"{text!r}: the greedy output {tok.decode(free)!r} never stops"
        payload = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 16} | stop,
                   "return_logprob": True}
        on_server, on_embedded = asyncio.run(both(payload))
        for response in (on_server, on_embedded):
            assert [token for _, token, _ in response["meta_info"]["output_token_logprobs"]] == free[:n]
        reasons = [r["meta_info"]["finish_reason"] for r in (on_server, on_embedded)]
        assert reasons[0] == reasons[1] and reasons[0]["type"] == "stop", reasons
        matched = reasons[0]["matched"]
        if isinstance(matched, str):
            assert action_text(tok, free[:n], matched).endswith(matched)
    embedded.shutdown()


def still_running_when_paused(url: str, prompt: list[int]) -> tuple[int, float]:
    """(max_new_tokens, seconds to wait before pausing) for a request still decoding at the pause,
    however fast this machine is: about 10 s of decoding, paused after a fifth of it."""
    started = time.perf_counter()
    generate(url, [prompt], max_new_tokens=64)
    tokens_per_s = 64 / (time.perf_counter() - started)
    n_tokens = int(min(max(10 * tokens_per_s, 100), 1900))  # the tiny model holds 2048 tokens
    return n_tokens, 0.2 * n_tokens / tokens_per_s


@needs_sglang
def test_an_aborted_request_returns_its_partial_output(server, hf_model, prompts):
    client = HTTPEngineClient([server.url])
    n_tokens, pause_after = still_running_when_paused(server.url, prompts[0])

    async def main():
        long = {"input_ids": prompts[0], "return_logprob": True,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": n_tokens, "ignore_eos": True}}
        task = asyncio.create_task(client.generate(long))
        await asyncio.sleep(pause_after)
        await client.abort_own()
        return await asyncio.wait_for(task, 60)

    aborted = asyncio.run(main())
    meta = aborted["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    n = len(aborted["output_ids"])
    assert 0 < n < n_tokens and meta["completion_tokens"] == n
    check = min(n, 24)
    assert aborted["output_ids"][:check] == hf_greedy(hf_model, prompts[0], check)[0]
    # Only the aborted request ended: the server serves new requests to the end.
    assert generate(server.url, prompts[:1], max_new_tokens=4)[0]["meta_info"]["finish_reason"]["type"] == "length"


def perturbed_copy(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The model with seeded noise added to every weight: other greedy outputs."""
    new_model = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in new_model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return new_model


@needs_sglang
def test_weight_update_from_disk_serves_the_new_weights(server, hf_model, prompts, tiny_model_path, one_rank, tmp_path):
    """An external server (rollout.server_url) updated from a folder written in 64 kB buckets."""
    cfg = SimpleNamespace(server_url=server.url, weight_sync="disk", weight_bucket_mb=1 / 16, weights_dir=str(tmp_path),
                          request_timeout=600.0)
    engine = SGLangEngine.connect(cfg, tiny_model_path)
    new_model = perturbed_copy(hf_model, seed=1)
    before = [r["output_ids"] for r in generate(server.url, prompts)]
    engine.update_weights(new_model.named_parameters(), weight_version="step1")
    after = generate(server.url, prompts)
    for prompt, response in zip(prompts, after):
        assert response["output_ids"] == hf_greedy(new_model, prompt, 16)[0]
        assert response["meta_info"]["weight_version"] == "step1"
    assert [r["output_ids"] for r in after] != before
    # Back to the original weights (the next update replaces the previous folder).
    engine.update_weights(hf_model.named_parameters(), weight_version="step2")
    assert [r["output_ids"] for r in generate(server.url, prompts)] == before
    assert [p.name for p in engine.weights_dir.iterdir()] == ["step2"]
    engine.shutdown()
    assert not engine.weights_dir.exists() and server.alive()


@needs_sglang
def test_probe_sees_tempered_logprobs(server):
    assert returns_original_logprobs(server.url, 0.7) is False


@needs_sglang
@pytest.mark.slow
def test_probe_sees_untempered_logprobs_of_a_server_run_with_the_switch(tiny_model_path, hf_model, prompts):
    """With SGLANG_RETURN_ORIGINAL_LOGPROB=1, SGLang returns log-probabilities of softmax(logits) at any
    temperature: the probe says so (the trainer then warns that engine_mismatch and tis are biased)."""
    server = SGLangServer(SGLANG_PYTHON, tiny_model_path, CPU_ARGS,
                          {"PYTHONPATH": str(STUB), "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}).start()
    try:
        server.wait_ready(timeout=600)
        assert returns_original_logprobs(server.url, 0.7) is True
        response = generate(server.url, prompts[:1], temperature=0.7, max_new_tokens=8)[0]
        untempered = model_logps(hf_model, prompts[0], response["output_ids"])
        assert [lp for lp, _, _ in response["meta_info"]["output_token_logprobs"]] == pytest.approx(
            untempered, abs=1e-3)
    finally:
        server.shutdown()


@needs_sglang
def test_weight_update_from_tensor_buckets_serves_the_new_weights(server, hf_model, prompts, tiny_model_path, one_rank):
    """rollout.weight_sync=tensor through the real server: a weight-update session, 64 kB buckets in RL2's
    payload (by value on CPU; CUDA buckets carry IPC handles instead), the version the server reports."""
    assert server_version(server.url) in FLATTENED_BUCKET_VERSIONS
    engine = SGLangEngine([server.url], [server.url], "tensor", 2**16, tiny_model_path)
    new_model = perturbed_copy(hf_model, seed=2)
    before = [r["output_ids"] for r in generate(server.url, prompts)]
    engine.update_weights(new_model.named_parameters(), weight_version="tensor1")
    after = generate(server.url, prompts)
    for prompt, response in zip(prompts, after):
        assert response["output_ids"] == hf_greedy(new_model, prompt, 16)[0]
        assert response["meta_info"]["weight_version"] == "tensor1"
    engine.update_weights(hf_model.named_parameters(), weight_version="tensor2")
    assert [r["output_ids"] for r in generate(server.url, prompts)] == before


@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def moe(request, tmp_path_factory):
    """A server of a tiny mixture-of-experts model (SGLang runs them on CPU too) and that model."""
    path = make_tiny_moe(tmp_path_factory.mktemp(request.param), request.param)
    server = SGLangServer(SGLANG_PYTHON, path, CPU_ARGS, SERVER_ENV).start()
    try:
        server.wait_ready(timeout=600)
        yield SimpleNamespace(server=server, path=path,
                              model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    finally:
        server.shutdown()


@needs_sglang
@pytest.mark.parametrize("weight_sync", ["tensor", "disk"])
def test_moe_pushes_reach_every_expert(moe, prompts, weight_sync, one_rank, tmp_path):
    """The policy's experts, fused in transformers' memory, reach the server, which loads them one per
    expert: it then serves the pushed model's greedy tokens and log-probabilities. Before each push the
    server's weights are randomized (the check), so none of this comes from weights it already had."""
    engine = SGLangEngine([moe.server.url], [moe.server.url], weight_sync, 2**16, moe.path,
                          weights_dir=tmp_path, weights_dirs=[tmp_path])
    policy = perturbed_copy(moe.model, seed=3)
    engine.update_weights(policy.named_parameters(), weight_version="moe1")
    for prompt, response in zip(prompts, generate(moe.server.url, prompts, max_new_tokens=8)):
        tokens = response["output_ids"]
        assert tokens == hf_greedy(policy, prompt, 8)[0]
        served = [lp for lp, _, _ in response["meta_info"]["output_token_logprobs"]]
        assert served == pytest.approx(model_logps(policy, prompt, tokens), abs=1e-3)
    engine.update_weights(moe.model.named_parameters(), weight_version="moe2")
    assert [r["output_ids"] for r in generate(moe.server.url, prompts[:1], max_new_tokens=8)] == [
        hf_greedy(moe.model, prompts[0], 8)[0]]


@needs_sglang
def test_a_push_that_misses_parameters_names_them(moe, prompts, one_rank):
    """A push without the experts (as when their names were transformers' own, which SGLang's loader skips
    while it answers success) stops the run naming the server's parameters it left unwritten."""
    engine = SGLangEngine([moe.server.url], [moe.server.url], "tensor", 2**16, moe.path)
    no_experts = [(name, p) for name, p in moe.model.named_parameters() if ".experts." not in name]
    with pytest.raises(EngineError, match=r"did not write 4 parameters.*"
                                          r"layers\.0\.(mlp|block_sparse_moe)\.experts\.w13_weight"):
        engine.update_weights(no_experts, weight_version="partial")
    engine.update_weights(moe.model.named_parameters(), weight_version="whole")  # the server is whole again
    assert generate(moe.server.url, prompts[:1], max_new_tokens=4)[0]["output_ids"] == hf_greedy(
        moe.model, prompts[0], 4)[0]


@needs_sglang
def test_rank_pause_aborts_only_its_own_requests(server, prompts, one_rank):
    """SGLangEngine.pause_generation("abort") (partial rollouts) stops this rank's requests with their
    partial output, while another client's request on the same server runs to its end; requests
    made while paused wait for continue_generation."""
    engine = SGLangEngine.connect(SimpleNamespace(server_url=server.url, weight_sync="none", weight_bucket_mb=1.0,
                                                  weights_dir=None, request_timeout=600.0), "unused")
    other = HTTPEngineClient([server.url])
    n_tokens, pause_after = still_running_when_paused(server.url, prompts[0])
    params = {"temperature": 0.0, "max_new_tokens": n_tokens, "ignore_eos": True}

    async def main():
        mine = asyncio.create_task(engine.generate({"input_ids": prompts[0], "sampling_params": params}))
        theirs = asyncio.create_task(other.generate({"input_ids": prompts[1], "sampling_params": params}))
        await asyncio.sleep(pause_after)
        await engine.pause_generation("abort")
        aborted = await asyncio.wait_for(mine, 60)
        held = asyncio.create_task(engine.generate({"input_ids": prompts[2], "sampling_params": params | {
            "max_new_tokens": 2}}))
        await asyncio.sleep(0.5)
        assert not held.done()
        await engine.continue_generation()
        return aborted, await theirs, await held

    aborted, finished, held = asyncio.run(main())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(aborted["output_ids"]) < n_tokens
    assert finished["meta_info"]["finish_reason"]["type"] == "length" and len(finished["output_ids"]) == n_tokens
    assert held["meta_info"]["finish_reason"]["type"] == "length"


def test_launch_failure_quotes_the_server_log(tiny_model_path, tmp_path):
    """A server that exits before it is ready: the error quotes its log (here RL2's own Python with a flag
    SGLang does not know)."""
    server = SGLangServer(sys.executable, tiny_model_path, BAD_ARGS, log_dir=str(tmp_path)).start()
    with pytest.raises(EngineError, match=own_python_launch_failure()):
        server.wait_ready(timeout=120)
    assert not server.alive()


# A flag SGLang does not know: RL2's own Python fails on it whether or not sglang is installed beside RL2.
BAD_ARGS = CPU_ARGS | {"no_such_flag": 1}


def own_python_launch_failure() -> str:
    """What the log of a server started with RL2's own Python and BAD_ARGS ends with: without sglang beside
    RL2 Python's ModuleNotFoundError, in the one-environment install SGLang's refusal of the flag."""
    if importlib.util.find_spec("sglang") is None:
        return "(?s)exited with code 1.*No module named 'sglang'"
    return "(?s)exited with code 2.*unrecognized arguments: --no-such-flag"


def test_a_python_named_by_its_command_runs_the_server(tiny_model_path, tmp_path, monkeypatch):
    """rollout.server_python=python3 (a command on PATH, not a path): the wrapper that makes the server die
    with the trainer re-executes it with os.execv, which searches no PATH. Here RL2's own Python, found on
    PATH under its bare name, gets as far as SGLang's launch (see own_python_launch_failure); an unknown name
    is refused naming the key."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    server = SGLangServer(Path(sys.executable).name, tiny_model_path, BAD_ARGS, log_dir=str(tmp_path)).start()
    assert Path(server.command[0]).is_absolute()
    with pytest.raises(EngineError, match=own_python_launch_failure()):
        server.wait_ready(timeout=120)
    with pytest.raises(ConfigError, match="rollout.server_python.*'no-such-python3'"):
        resolve_engine(SimpleNamespace(engine="auto", server_url=None, server_python="no-such-python3"),
                       torch.device("cuda"))


# ---- the PPO trainer with SGLang as its engine ------------------------------------------------

# Rewards that differ within most groups of a random model's answers, so that GRPO updates the weights.
PARITY_ENV = """
async def step(state, action, extra_info):
    reward = float(sum(map(ord, action)) % 2)
    return {"next_state": None, "reward": reward, "score": reward, "done": True, "extra_info": extra_info}
"""


def ppo_args(model: str, tmp_path: Path, *extra: str) -> list[str]:
    rows = "".join(f'{{"prompt": "question {k}", "extra_info": {{}}}}\n' for k in range(8))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "parity.py").write_text(PARITY_ENV)
    return ["-m", "RL2.trainer.ppo", f"data.train.path={tmp_path / 'train.jsonl'}", "data.train.batch_size=4",
            f"rollout.env_path={tmp_path / 'parity.py'}", "rollout.responses_per_prompt=4",
            "rollout.train_sampling_params.max_new_tokens=8", f"actor.model_name={model}", "actor.dtype=float32",
            "actor.optimizer.lr=1e-2", "actor.max_length_per_device=512", f"trainer.save_dir={tmp_path / 'run'}",
            "trainer.total_steps=2", "rollout.weight_bucket_mb=0.25", *extra]


def assert_engine_followed_the_actor(run: Path, initial_model: str) -> None:
    """Both steps ran, and at step 2 the engine's log-probabilities are the updated actor's: the weight
    sync after step 1 reached the server (without it the gap is ~0.1 nats per token at this lr)."""
    metrics = [m for m in read_metrics(run) if "actor/engine_mismatch" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["actor/engine_mismatch"] < 1e-3 for m in metrics), metrics
    initial = load_file(f"{initial_model}/model.safetensors")
    final = load_file(f"{run}/final/actor/model.safetensors")
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


@needs_sglang
def test_ppo_with_an_external_server(server, tiny_model_path, tmp_path):
    """rollout.server_url: the trainer launches nothing, samples from the module's server at temperature
    0.7 and updates its weights from disk after each step; the engine's log-probabilities are the
    trainer's at that temperature (engine_mismatch near 0), as with the embedded engine. (Runs after the
    tests that read the
    server's initial weights: it leaves the trained weights in the server.)"""
    run_ranks(1, ppo_args(tiny_model_path, tmp_path, f"rollout.server_url={server.url}",
                          "rollout.train_sampling_params.temperature=0.7"), timeout=600)
    assert_engine_followed_the_actor(tmp_path / "run", tiny_model_path)


@needs_sglang
def test_ppo_with_lora_pushes_merged_weights(server, tiny_model_path, tmp_path):
    """actor.lora.rank > 0: the server gets the base weights with the adapters merged in, under the base
    model's names, after each update (engine_mismatch near 0, as without LoRA)."""
    control_request(server.url, "/update_weights_from_disk", {"model_path": tiny_model_path, "flush_cache": True})
    run_ranks(1, ppo_args(tiny_model_path, tmp_path, f"rollout.server_url={server.url}", "actor.lora.rank=4",
                          "rollout.train_sampling_params.temperature=0.7"), timeout=600)
    assert_engine_followed_the_actor(tmp_path / "run", tiny_model_path)
    assert (tmp_path / "run" / "final" / "actor" / "adapter" / "adapter_model.safetensors").exists()


@needs_sglang
@pytest.mark.slow
def test_ppo_launches_its_sglang_server(tiny_model_path, tmp_path):
    """rollout.engine=sglang: the trainer launches a server from the SGLang environment (log-probabilities at
    the sampling temperature, as the trainer's: engine_mismatch near 0 at temperature 0.7), pushes the weights in
    buckets through
    a folder after each update, and stops the server at exit."""
    run_ranks(1, ppo_args(tiny_model_path, tmp_path, "rollout.engine=sglang",
                          f"rollout.server_python={SGLANG_PYTHON}", f"rollout.server_env.PYTHONPATH={STUB}",
                          "rollout.server_args.max_total_tokens=4096", f"rollout.server_log_dir={tmp_path / 'logs'}",
                          "rollout.train_sampling_params.temperature=0.7", "trainer.seed=7"),
              timeout=900)
    assert_engine_followed_the_actor(tmp_path / "run", tiny_model_path)
    log_path = next((tmp_path / "logs").glob("sglang-*.log"))
    assert "--device cpu" in log_path.read_text() and "--dtype float32" in log_path.read_text()
    assert "--random-seed 7" in log_path.read_text()  # the run's seed: another seed samples differently
    port = log_path.stem.removeprefix("sglang-")
    with pytest.raises(httpx.TransportError):  # stopped when the trainer exited
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
