"""What the agent endpoint costs a rollout: the same rollout through each of its APIs and through direct engine calls.

    python benchmarks/bench_agent_endpoint.py [--prompts 8] [--samples 4] [--new-tokens 32] [--repeats 3]
                                              [--threads N] [--tiny]

Workload: N prompts x k samples, each a two-turn chat (the question, the model's answer, a follow-up,
its second answer), on the embedded engine serving SmolLM2-135M-Instruct (`--tiny`: a tiny random
Llama, a check of the script itself), exactly `--new-tokens` tokens per answer at temperature 1.

- endpoint: `agent_rollout_batch` runs this file's `run` once per sample, written against one API per phase:
  `chat` (`openai.AsyncOpenAI`'s chat completions), `chat stream` (the same, `stream=True`), `responses`
  (OpenAI's Responses API, the second call by `previous_response_id`) and `messages` (`anthropic.AsyncAnthropic`);
  every call goes over HTTP to `RL2.agents.endpoint`, which renders the messages, matches them to the session's
  sequence and samples.
- direct: the same conversations as the environment loop drives them: render, tokenise what the
  next prompt adds (`RL2.rollout.loop.continuation`), `engine.generate` with the token ids.

All sample with the same per-call seeds, so they generate the same tokens (checked: the table
counts the trajectories whose token ids agree with direct calls'); the difference in time is the endpoint's (HTTP,
JSON, the client). The phases run back to back in each repeat, in rotating order; the table
shows medians, so a machine shared with other processes slows both alike, and the CPU seconds of
this process beside the wall time: on a busy machine a phase's wall time depends on what else runs,
its CPU time much less (with `--threads 1` no OpenMP thread spins either). Target: at most 5%.
Peak RSS is per phase (the kernel's high-water mark is reset before each phase where Linux allows).
"""

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anthropic
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from RL2.agents.agent import agent_rollout_batch, load_agent  # noqa: E402
from RL2.agents.endpoint import OpenAIEndpoint  # noqa: E402
from RL2.engine.embedded.engine import EmbeddedEngine  # noqa: E402
from RL2.models.default_model import resolve_model_path  # noqa: E402
from RL2.native import use_huge_pages  # noqa: E402
from RL2.rollout.loop import continuation, sample_seed  # noqa: E402
from RL2.rollout.tools.tool_calls import tool_call_parser  # noqa: E402
from RL2.utils.memory import peak_rss_gb, reset_peak_rss  # noqa: E402
from tests.helpers.tiny import make_tiny_model  # noqa: E402


@dataclass
class Phase:
    """One timed rollout: wall seconds, CPU seconds of this process (all its threads), peak RSS."""

    wall: float
    cpu: float
    rss_mb: float


FOLLOW_UP = "Check your answer, then give it again."
QUESTIONS = ["What is {a} + {b}?", "Name a word that rhymes with 'cat' ({a}).", "Write a haiku about the number {b}."]


APIS = ["chat", "chat stream", "responses", "messages"]
_claude: list[anthropic.AsyncAnthropic] = []  # one Anthropic client (and connection pool) for all runs


async def run(client, extra_info):
    """The agent: two calls of one conversation, through the API `extra_info["api"]`."""
    api, question = extra_info["api"], {"role": "user", "content": extra_info["prompt"]}
    follow_up = {"role": "user", "content": FOLLOW_UP}
    if api == "responses":
        first = await client.responses.create(model="policy", input=[question])
        await client.responses.create(model="policy", input=[follow_up], previous_response_id=first.id)
    elif api == "messages":
        if not _claude:
            _claude.append(anthropic.AsyncAnthropic(api_key=client.api_key, max_retries=0))
        claude = _claude[0].with_options(base_url=str(client.base_url).removesuffix("/").removesuffix("/v1"))
        first = await claude.messages.create(model="policy", max_tokens=extra_info["tokens"], messages=[question])
        await claude.messages.create(model="policy", max_tokens=extra_info["tokens"],
                                     messages=[question, {"role": "assistant", "content": first.content}, follow_up])
    else:
        stream = api == "chat stream"
        messages = [question]
        first = await client.chat.completions.create(model="policy", messages=messages, stream=stream)
        if stream:
            first = "".join([chunk.choices[0].delta.content or "" async for chunk in first if chunk.choices])
        else:
            first = first.choices[0].message.content
        messages += [{"role": "assistant", "content": first}, follow_up]
        second = await client.chat.completions.create(model="policy", messages=messages, stream=stream)
        if stream:
            [chunk async for chunk in second]
    return 1.0


def main() -> None:
    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="trajectories per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens of each answer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M-Instruct")
    args = parser.parse_args()
    for flag in ("prompts", "samples", "new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        with tempfile.TemporaryDirectory(prefix="rl2_bench_tiny_") as folder:
            asyncio.run(measure(args, make_tiny_model(Path(folder)), "a tiny random Llama"))
    else:
        asyncio.run(measure(args, resolve_model_path("smollm2-135m-instruct"), "SmolLM2-135M-Instruct"))


async def measure(args, path: str, name: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = EmbeddedEngine(model, tokenizer, max_running_requests=max(64, args.prompts * args.samples))
    params = {"temperature": 1.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
    endpoint = OpenAIEndpoint(engine, tokenizer, tool_call_parser("auto", tokenizer), False, params, None)
    await endpoint.start()
    agent = load_agent(__file__)
    rows = [{"prompt": QUESTIONS[i % 3].format(a=3 * i + 4, b=7 * i + 9), "sampling_seed": i}
            for i in range(args.prompts)]

    def endpoint_rollout(api: str):
        async def rollout():
            rows_of_api = [row | {"extra_info": {"api": api, "tokens": args.new_tokens}} for row in rows]
            groups = await agent_rollout_batch(endpoint, agent, rows_of_api, args.samples, None)
            faults = [t.fault for g in groups for t in g if t.fault]
            if faults:
                sys.exit(f"an agent run through {api} failed: {faults[0]}")
            return [[t.token_sequences()[0]["input_ids"] for t in g] for g in groups]
        return rollout

    async def direct():
        return await direct_rollout(engine, tokenizer, rows, args.samples, params)

    order = [("direct", direct)] + [(api, endpoint_rollout(api)) for api in APIS]
    for _, rollout in order:  # warm-up: lazy initialisation of every path
        await rollout()
    phases = {label: [] for label, _ in order}
    tokens = {}
    for repeat in range(args.repeats):
        for label, rollout in order[repeat % len(order):] + order[:repeat % len(order)]:
            reset_peak_rss()
            start, cpu = time.perf_counter(), time.process_time()
            tokens[label] = await rollout()
            phases[label].append(Phase(time.perf_counter() - start, time.process_time() - cpu, peak_rss_gb() * 1e3))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{label} {phases[label][-1].wall:.2f} s "
                                                   f"({phases[label][-1].cpu:.2f} CPU s)" for label in phases),
              flush=True)
    await endpoint.stop()
    engine.shutdown()
    report(args, name, phases, tokens, torch.get_num_threads())


async def direct_rollout(engine, tokenizer, rows: list[dict], samples: int, params: dict) -> list[list[list[int]]]:
    """The agent's conversations through `engine.generate`, seeded as the endpoint seeds each call; the
    token ids of each trajectory's one sequence."""
    def render(messages):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    async def sample(ids, seed):
        response = await engine.generate({"input_ids": ids, "sampling_params": {**params, "sampling_seed": seed},
                                          "return_logprob": True})
        return [int(token) for _, token, _ in response["meta_info"]["output_token_logprobs"]]

    async def trajectory(row, j):
        seed = sample_seed(row["sampling_seed"], j)
        messages = [{"role": "user", "content": row["prompt"]}]
        prompt = render(messages)
        ids = encode(prompt)
        answer = await sample(ids, sample_seed(seed, 0))
        text = tokenizer.decode(answer, skip_special_tokens=True)
        end = tokenizer.decode(answer[-1:]) if answer[-1] in tokenizer.all_special_ids else ""
        later = render(messages + [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}])
        ids = ids + answer + encode(continuation(prompt, text, later, end))
        return ids + await sample(ids, sample_seed(seed, 1))

    tasks = [[asyncio.create_task(trajectory(row, j)) for j in range(samples)] for row in rows]
    return [[await task for task in group] for group in tasks]


def report(args, name: str, phases: dict, tokens: dict, threads: int) -> None:
    """A row per phase: its medians, and against direct calls its overhead (the median over repeats of the ratio
    of the two phases of one repeat), its extra CPU per call and how many trajectories sampled the same tokens."""
    def median(label: str, field: str) -> float:
        return statistics.median(getattr(phase, field) for phase in phases[label])

    def overhead(label: str, field: str) -> float:
        pairs = zip(phases[label], phases["direct"])
        return statistics.median(100 * (getattr(e, field) / getattr(d, field) - 1) for e, d in pairs)

    calls = 2 * args.prompts * args.samples
    print(f"\n{args.prompts} prompts x {args.samples} samples x 2 calls x {args.new_tokens} new tokens, {name} "
          f"float32 on the embedded engine, {threads} threads, median of {args.repeats}\n")
    print("| rollout | s | CPU s | overhead % wall (CPU) | CPU ms per call | identical trajectories | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for label in phases:
        same = [e == d for ge, gd in zip(tokens[label], tokens["direct"]) for e, d in zip(ge, gd)]
        served = label != "direct"
        print(f"| {'direct engine.generate' if not served else 'endpoint, ' + label} | {median(label, 'wall'):.2f} | "
              f"{median(label, 'cpu'):.2f} | "
              + (f"{overhead(label, 'wall'):.1f} ({overhead(label, 'cpu'):.1f}) | "
                 f"{1e3 * (median(label, 'cpu') - median('direct', 'cpu')) / calls:.1f} | " if served else "- | - | ")
              + f"{sum(same)}/{len(same)} | {max(p.rss_mb for p in phases[label]):.0f} |")


if __name__ == "__main__":
    main()
