"""Log-probs and entropies of a step's logits on CPU: the chunked path (`RL2/models/chunked_logps.py`)
at several chunk sizes, against a plain float32 log-softmax, in the same run.

    python benchmarks/bench_logps.py [--tokens 1024] [--vocab 49152] [--repeats 5]

Forward and backward of (log p(label), entropy) for `[tokens, vocab]` float32 logits on one core (each
rank of a CPU run has one), as the update of W1 (`bench_ppo_w1.py`) computes them: 1024 sampled tokens
on a rank, SmolLM2's vocabulary. Each setting runs in a process of its own; prints the best of
`repeats` rounds and the process's peak resident memory.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {  # name -> float32 elements per chunk (None: the plain log-softmax)
    "chunked, 4 MB chunks": 1 << 20,
    "chunked, 1 MB chunks (default)": 1 << 18,
    "chunked, 256 KB chunks": 1 << 16,
    "plain log_softmax": None,
}
WORKER = """
import json, resource, sys, time
import torch
torch.set_num_threads(1)
import RL2.models.chunked_logps as chunked
tokens, vocab, repeats, chunk = json.loads(sys.argv[1])
generator = torch.Generator().manual_seed(0)
logits = (3 * torch.randn(tokens, vocab, generator=generator)).requires_grad_()
labels = torch.randint(0, vocab, (tokens,), generator=generator)
weights = torch.randn(2, tokens, generator=generator)

def plain():
    log_probs = torch.log_softmax(logits, -1)
    return log_probs.gather(-1, labels[:, None])[:, 0], -(log_probs.exp() * log_probs).sum(-1)

if chunk is not None:
    chunked.CHUNK_ELEMENTS = chunk
forward = plain if chunk is None else lambda: chunked.LogpsAndEntropy.apply(logits, labels, True, 1.0)
best_forward = best_backward = float("inf")
for _ in range(repeats + 1):  # the first round warms up
    began = time.perf_counter()
    logps, entropy = forward()
    middle = time.perf_counter()
    (logps * weights[0] + entropy * weights[1]).sum().backward()
    ended = time.perf_counter()
    logits.grad = None
    best_forward, best_backward = min(best_forward, middle - began), min(best_backward, ended - middle)
print(json.dumps([best_forward, best_backward, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{args.tokens} tokens x {args.vocab} vocabulary, float32, one core; best of {args.repeats}\n")
    print("| setting | forward (s) | backward (s) | forward + backward (s) | peak RSS (GB) |")
    print("|---|---|---|---|---|")
    for name, chunk in SETTINGS.items():
        out = subprocess.run([sys.executable, "-c", WORKER, json.dumps([args.tokens, args.vocab, args.repeats, chunk])],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
        forward, backward, peak_gb = json.loads(out.strip().splitlines()[-1])
        print(f"| {name} | {forward:.3f} | {backward:.3f} | {forward + backward:.3f} | {peak_gb:.2f} |")


if __name__ == "__main__":
    main()
