"""Generation throughput of the embedded engine against Hugging Face `generate`, in one process.

    python benchmarks/bench_engine.py [--repeats 3] [--requests 32] [--new-tokens 64] [--dtype auto] [--threads N]

Workload: the embedded SmolLM2-135M-Instruct, 32 chat-formatted prompts, exactly 64 new tokens
each, sampled at temperature 1. The engine gets 32 concurrent `generate`
calls (ignore_eos, with log-probabilities, as RL rollouts ask for them); HF `generate` gets the same
token ids as one left-padded batch (do_sample, no top-k, min_new_tokens = max_new_tokens, no
log-probabilities). Both run back to back in every repeat and the table shows medians, so a
machine shared with other processes slows both alike. HF `generate` runs on the thread the engine's
forwards run on (the event loop's, or a worker thread where torch's threads outnumber the cores; see
`embedded_engine.py`): libgomp's OpenMP pools then wait between parallel regions the same way for
both. Also timed: one `update_weights` with every parameter of the model as fresh tensors, as the
trainer sends them after an update.
Peak RSS is per phase (the kernel's high-water mark is reset before each phase where Linux allows).
"""

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from RL2.engine.embedded.engine import EmbeddedEngine
from RL2.models.default_model import resolve_model_path
from RL2.models.precision import compute_dtype
from RL2.native import use_huge_pages
from RL2.utils.memory import peak_rss_gb, reset_peak_rss


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    questions = [
        f"What is {3 * i + 4} + {7 * i + 9}?" if i % 2 else f"Name a word that rhymes with 'cat' ({i})."
        for i in range(n)
    ]
    chats = [[{"role": "user", "content": q}] for q in questions]
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"] for c in chats]


def hf_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> int:
    """Sample `new_tokens` for every prompt with HF `generate`; returns the tokens generated."""
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id,
        )
    return (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]


def engine_generate(engine: EmbeddedEngine, prompts: list[list[int]], new_tokens: int) -> int:
    """The same requests, concurrently, through the engine; returns the tokens generated."""
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}

    async def main():
        payloads = [{"input_ids": p, "sampling_params": params, "return_logprob": True} for p in prompts]
        return await asyncio.gather(*(engine.generate(p) for p in payloads))

    results = asyncio.run(main())
    assert all(len(r["meta_info"]["output_token_logprobs"]) == new_tokens for r in results)
    return sum(r["meta_info"]["completion_tokens"] for r in results)


def timed(fn, *args) -> tuple[float, float]:
    """(tokens/s, peak RSS in MB) of one call of fn, which returns a token count."""
    reset_peak_rss()
    start = time.perf_counter()
    tokens = fn(*args)
    return tokens / (time.perf_counter() - start), peak_rss_gb() * 1e3


def main() -> None:
    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto (bfloat16 where native, else float32), bfloat16, float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    dtype = compute_dtype(args.dtype, torch.device("cpu"))  # what the trainer's engine would run in
    args.dtype = str(dtype).removeprefix("torch.")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    prompts = chat_prompts(tokenizer, args.requests)
    engine = EmbeddedEngine(model, tokenizer, max_running_requests=max(64, args.requests))
    hf_thread = ThreadPoolExecutor(max_workers=1)

    def on_engine_thread(fn, *args):
        return fn(*args) if engine.steps_on_loop else hf_thread.submit(fn, *args).result()

    on_engine_thread(hf_generate, model, tokenizer, prompts[:4], 2)  # warm-up: lazy init
    engine_generate(engine, prompts[:4], 2)

    hf, ours = [], []
    for i in range(args.repeats):
        hf.append(on_engine_thread(timed, hf_generate, model, tokenizer, prompts, args.new_tokens))
        ours.append(timed(engine_generate, engine, prompts, args.new_tokens))
        print(f"repeat {i + 1}: HF {hf[-1][0]:.1f} tok/s, engine {ours[-1][0]:.1f} tok/s", flush=True)

    # What the trainer sends after an update: every parameter (tied ones once) as new tensors.
    fresh = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    syncs = []
    for version in range(max(3, args.repeats)):
        start = time.perf_counter()
        engine.update_weights(fresh, weight_version=str(version))
        syncs.append(time.perf_counter() - start)
    engine.shutdown()

    hf_tps, our_tps = statistics.median(t for t, _ in hf), statistics.median(t for t, _ in ours)
    ratio = statistics.median(o[0] / h[0] for o, h in zip(ours, hf))
    print(
        f"\n{args.requests} requests x {args.new_tokens} new tokens, SmolLM2-135M-Instruct {args.dtype}, "
        f"{torch.get_num_threads()} threads, "
        f"forwards on {'the event loop' if engine.steps_on_loop else 'a worker thread'}, "
        f"median of {args.repeats}"
    )
    rows = [
        ("HF generate tokens/s", f"{hf_tps:.1f}"),
        ("embedded engine tokens/s", f"{our_tps:.1f}"),
        ("ratio engine / HF", f"{ratio:.2f}x"),
        ("weight sync s (median; first)", f"{statistics.median(syncs):.3f}; {syncs[0]:.3f}"),
        ("peak RSS MB (HF phase; engine phase)", f"{max(r for _, r in hf):.0f}; {max(r for _, r in ours):.0f}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}} | {value}")


if __name__ == "__main__":
    main()
