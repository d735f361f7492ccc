"""How fast the trajectory viewer opens a large run: N trajectories of T response tokens each, every one with its
per-token columns (rollout.save_sample_tokens=T), through the HTTP API the page calls.

    python benchmarks/bench_viewer.py                      # 10,000 trajectories of 2,048 tokens
    python benchmarks/bench_viewer.py --samples 50 --tokens 16

Prints a table: the samples.jsonl written, then the seconds from starting the server to the page's first answers
(status, steps, the first page of the list), a filtered search, one trajectory with its tokens, and one GRPO group.
"""

import argparse
import json
import random
import tempfile
import time
import urllib.request
from pathlib import Path

from RL2.viewer.server import serve


def write_run(folder: Path, n: int, tokens: int, group_size: int = 8, seed: int = 0) -> int:
    rng = random.Random(seed)
    words = ["the", " answer", " is", " 42", "\n", "<tool_call>", " step", " so", " we", " add"]
    per_step = 64 * group_size
    with open(folder / "samples.jsonl", "w") as f:
        for i in range(n):
            text = [rng.choice(words) for _ in range(tokens)]
            record = {"step": i // per_step + 1, "group": i % per_step // group_size,
                      "prompt": f"question {i % per_step}",
                      "response": "".join(text), "reward": float(rng.random() < 0.5), "score": 0.0, "n_turns": 1,
                      "finish_reason": "stop", "stop_reason": "done", "fault": None, "response_length": tokens,
                      "n_sequences": 1, "data_source": rng.choice(["gsm8k", "math"])}
            logps = [round(-rng.random() * 3, 4) for _ in range(2 * tokens)]
            record["tokens"] = {"n_tokens": tokens, "text": text, "mask": [1] * tokens, "logp": logps[:tokens],
                                "version": [0] * tokens, "adv": [0.5] * tokens, "trainer_logp": logps[tokens:]}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    steps = (n + per_step - 1) // per_step
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "rollout/reward": rng.random(), "actor/loss": rng.random()}) + "\n")
    return (folder / "samples.jsonl").stat().st_size


def get(base: str, path: str):
    with urllib.request.urlopen(base + path, timeout=60) as response:
        return json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        size = write_run(folder, args.samples, args.tokens)
        began = time.perf_counter()
        server = serve(folder, 0)
        base = f"http://127.0.0.1:{server.server_address[1]}"
        times = {}
        try:
            status = get(base, "/api/status")
            get(base, "/api/metrics")
            get(base, "/api/steps")
            first = get(base, "/api/samples?limit=50")
            times["open: index, status, curves, steps, first page"] = time.perf_counter() - began
            assert status["n_samples"] == args.samples and len(first["rows"]) == min(50, args.samples)
            for name, path in (("filter: a step, reward >= 1, text search",
                                "/api/samples?step=1&min_reward=1&q=answer"),
                               ("one trajectory with its tokens", f"/api/sample?id={args.samples // 2}"),
                               ("one GRPO group (8 trajectories)", "/api/group?step=1&group=0")):
                began = time.perf_counter()
                get(base, path)
                times[name] = time.perf_counter() - began
        finally:
            server.shutdown()
    print(f"{args.samples} trajectories x {args.tokens} tokens with per-token columns: "
          f"samples.jsonl {size / 2**20:.0f} MiB")
    print("| request | s |")
    print("|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
