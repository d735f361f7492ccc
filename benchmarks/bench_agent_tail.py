"""What a synchronous agent rollout spends on its tail: the time its first groups take against the whole rollout.

    python benchmarks/bench_agent_tail.py [--prompts 16] [--batch 8] [--samples 4] [--long-calls 6]
                                          [--new-tokens 32] [--repeats 3] [--tiny]

Workload: `--prompts` groups of `--samples` runs of this file's agent on the embedded engine serving
SmolLM2-135M-Instruct in bfloat16 (`--tiny`: a tiny random Llama, a check of the script itself), every answer
exactly `--new-tokens` tokens; one prompt in 4 asks `--long-calls` questions in one conversation, the others one
(the long tail of benchmarks/envs/long_tail.py, as an agent). A partial rollout with `--batch` groups to train
(`rollout.over_sampling` = prompts - batch) would stop once `--batch` groups had finished; agents cannot be
carried (docs/async.md, "Agents"), so the table shows what that costs: the share of the rollout's wall time
spent after the batch had finished. Medians over the repeats.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from RL2.agents.agent import agent_rollout_batch, load_agent  # noqa: E402
from RL2.agents.endpoint import OpenAIEndpoint  # noqa: E402
from RL2.engine.embedded.engine import EmbeddedEngine  # noqa: E402
from RL2.models.default_model import resolve_model_path  # noqa: E402
from RL2.rollout.event_loop import run_on_rank_loop  # noqa: E402
from RL2.rollout.tools.tool_calls import tool_call_parser  # noqa: E402
from tests.helpers.tiny import make_tiny_model  # noqa: E402


async def run(client, extra_info):
    """The agent: `calls` questions of one conversation; returns when it finished."""
    messages = list(extra_info["prompt"])
    for _ in range(extra_info["calls"]):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": "Another one."}]
    return {"reward": 1.0, "metrics": {"finished_at": time.perf_counter()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="groups in flight")
    parser.add_argument("--batch", type=int, default=8, help="groups a partial rollout would stop at")
    parser.add_argument("--samples", type=int, default=4, help="runs per prompt")
    parser.add_argument("--long-calls", type=int, default=6, help="calls of a long run (the others make one)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens of each answer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M-Instruct")
    args = parser.parse_args()
    if not 1 <= args.batch <= args.prompts:
        parser.error(f"--batch {args.batch}: give 1 to --prompts ({args.prompts})")
    if args.tiny:
        with tempfile.TemporaryDirectory(prefix="rl2_bench_tiny_") as folder:
            measure(args, make_tiny_model(Path(folder)), "a tiny random Llama")
    else:
        measure(args, resolve_model_path("smollm2-135m-instruct"), "SmolLM2-135M-Instruct")


def measure(args, path: str, name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    engine = EmbeddedEngine(model, tokenizer, max_running_requests=max(64, args.prompts * args.samples))
    params = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    endpoint = OpenAIEndpoint(engine, tokenizer, tool_call_parser("auto", tokenizer), False, params, None)
    agent = load_agent(__file__)
    rows = [{"prompt": [{"role": "user", "content": f"Tell me a fact about the number {i}."}], "sampling_seed": i,
             "extra_info": {"calls": args.long_calls if i % 4 == 0 else 1}} for i in range(args.prompts)]
    whole, batch, tokens = [], [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        groups = run_on_rank_loop(agent_rollout_batch(endpoint, agent, rows, args.samples, None))
        whole.append(time.perf_counter() - start)
        finished = sorted(max(t.metrics["finished_at"] for t in group) - start for group in groups)
        batch.append(finished[args.batch - 1])
        tokens.append(sum(t.response_length for group in groups for t in group))
    whole_s, batch_s = statistics.median(whole), statistics.median(batch)
    print(f"{name}, {args.prompts} groups x {args.samples} runs, {args.new_tokens} tokens an answer, one prompt in 4 "
          f"with {args.long_calls} calls; medians of {args.repeats}\n")
    print("| rollout s | first {} groups s | share after them | tokens | tokens/s |".format(args.batch))
    print("|---|---|---|---|---|")
    print(f"| {whole_s:.1f} | {batch_s:.1f} | {1 - batch_s / whole_s:.0%} | {statistics.median(tokens):.0f} | "
          f"{statistics.median(tokens) / whole_s:.0f} |")


if __name__ == "__main__":
    main()
