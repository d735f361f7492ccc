"""Generation throughput of SGLang on CPU for the embedded model, through RL2's HTTP client, against RL2's
embedded engine on the same workload in the same run.

    RL2_SGLANG_PYTHON=~/.cache/rl2/sglang-venv/bin/python python benchmarks/bench_sglang_cpu.py [--repeats 3]

The same workload as benchmarks/bench_engine.py: SmolLM2-135M-Instruct, 32 chat-formatted prompts
sent concurrently, exactly 64 new tokens each (ignore_eos) at temperature 1, with log-probabilities,
as RL rollouts ask for them. The server runs from the SGLang environment (RL2_SGLANG_PYTHON) on CPU,
with tests/sglang_stub on its path (SGLang's CPU path imports one vLLM op it never calls), and its
own thread count (`--threads`, default: every core). The baseline, once the server has stopped: the
embedded engine in this process, in float32 on as many threads, the same requests (the median of as
many repeats). Also timed: one weight update from disk (the trainer's disk weight sync: writing the
folder and the server loading it).
"""

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import engine_generate  # noqa: E402

from RL2.engine.embedded.engine import EmbeddedEngine  # noqa: E402
from RL2.engine.sglang.engine import control_request  # noqa: E402
from RL2.engine.sglang.http_client import HTTPEngineClient  # noqa: E402
from RL2.engine.sglang.server import SGLangServer  # noqa: E402
from RL2.engine.sglang.weight_transfer import buckets, write_hf_folder  # noqa: E402
from RL2.models.default_model import resolve_model_path  # noqa: E402
from RL2.native import use_huge_pages  # noqa: E402

STUB = Path(__file__).resolve().parent.parent / "tests" / "sglang_stub"


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    questions = [f"What is {3 * i + 4} + {7 * i + 9}?" if i % 2 else f"Name a word that rhymes with 'cat' ({i})."
                 for i in range(n)]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def generate(client: HTTPEngineClient, prompts: list[list[int]], new_tokens: int) -> int:
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}

    async def main():
        payloads = [{"input_ids": p, "sampling_params": params, "return_logprob": True} for p in prompts]
        return await asyncio.gather(*(client.generate(p) for p in payloads))

    results = asyncio.run(main())
    assert all(len(r["meta_info"]["output_token_logprobs"]) == new_tokens for r in results)
    return sum(r["meta_info"]["completion_tokens"] for r in results)


def embedded_rates(model_path: str, tokenizer, prompts: list[list[int]], new_tokens: int, repeats: int) -> list[float]:
    """Tokens/s of the embedded engine on the same requests, float32, after the same warm-up."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    engine = EmbeddedEngine(model, tokenizer, max_running_requests=max(64, len(prompts)))
    try:
        engine_generate(engine, prompts[:2], 4)  # warm-up
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            tokens = engine_generate(engine, prompts, new_tokens)
            rates.append(tokens / (time.perf_counter() - start))
    finally:
        engine.shutdown()
    return rates


def main() -> None:
    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    python = os.environ.get("RL2_SGLANG_PYTHON")
    if not python:
        sys.exit("set RL2_SGLANG_PYTHON to the python of a virtual environment with sglang (see .ci/run)")
    model_path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = chat_prompts(tokenizer, args.requests)
    server_args = {"device": "cpu", "dtype": "float32", "max_total_tokens": 16384, "sleep_on_idle": True}
    env = {"PYTHONPATH": str(STUB), "OMP_NUM_THREADS": str(args.threads)}
    began = time.perf_counter()
    server = SGLangServer(python, model_path, server_args, env).start()
    try:
        server.wait_ready(timeout=900)
        print(f"server ready in {time.perf_counter() - began:.0f} s ({server.url}, log {server.log_path})")
        client = HTTPEngineClient([server.url], timeout=1800.0)
        generate(client, prompts[:2], 4)  # warm-up
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = generate(client, prompts, args.new_tokens)
            rates.append(tokens / (time.perf_counter() - start))
        model = AutoModelForCausalLM.from_pretrained(model_path)
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            write_hf_folder(buckets(model.named_parameters(), 512 * 2**20), Path(folder) / "w", model_path)
            control_request(server.url, "/update_weights_from_disk", {"model_path": f"{folder}/w", "flush_cache": True})
            sync_s = time.perf_counter() - start
    finally:
        server.shutdown()
    torch.set_num_threads(args.threads)
    baseline = embedded_rates(model_path, tokenizer, prompts, args.new_tokens, args.repeats)
    print(f"| engine | requests x new tokens | tokens/s (median of {args.repeats}) | all runs |")
    print("|---|---|---|---|")
    for name, runs in ((f"SGLang {args.threads} threads, float32, CPU", rates),
                       (f"embedded engine {args.threads} threads, float32", baseline)):
        print(f"| {name} | {args.requests} x {args.new_tokens} | {statistics.median(runs):.0f} | "
              f"{', '.join(f'{r:.0f}' for r in runs)} |")
    print(f"SGLang / embedded engine: {statistics.median(rates) / statistics.median(baseline):.2f}x")
    print(f"weight update from disk (write folder + server load): {sync_s:.2f} s")


if __name__ == "__main__":
    main()
