"""Log-probs and entropies of a step's logits on CPU: the chunked path (`RL2/models/chunked_logps.py`)
at several chunk sizes, and with the gradient written over the logits (the trainers' `last_use`),
against a plain float32 log-softmax, in the same run.

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
SETTINGS = {  # name -> (float32 elements per chunk (None: the plain log-softmax), gradient over the logits)
    "chunked, 4 MB chunks": (1 << 20, False),
    "chunked, 1 MB chunks (default)": (1 << 18, False),
    "chunked, 1 MB chunks, gradient over the logits (the trainers')": (1 << 18, True),
    "chunked, 256 KB chunks": (1 << 16, False),
    "plain log_softmax": (None, False),
}
WORKER = """
import json, resource, sys, time
import torch
torch.set_num_threads(1)
import RL2.models.chunked_logps as chunked
from RL2.native import use_huge_pages
use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do
tokens, vocab, repeats, chunk, overwrite = json.loads(sys.argv[1])
generator = torch.Generator().manual_seed(0)
source = 3 * torch.randn(tokens, vocab, generator=generator)
labels = torch.randint(0, vocab, (tokens,), generator=generator)
weights = torch.randn(2, tokens, generator=generator)

def plain():
    log_probs = torch.log_softmax(logits, -1)
    return log_probs.gather(-1, labels[:, None])[:, 0], -(log_probs.exp() * log_probs).sum(-1)

if chunk is not None:
    chunked.CHUNK_ELEMENTS = chunk
forward = plain if chunk is None else lambda: chunked.LogpsAndEntropy.apply(logits, labels, True, 1.0, overwrite)
best_forward = best_backward = float("inf")
for _ in range(repeats + 1):  # the first round warms up
    logits = source.clone().requires_grad_()  # fresh logits each round: `overwrite` turns them into their gradient
    began = time.perf_counter()
    logps, entropy = forward()
    middle = time.perf_counter()
    # The gradient as the output projection's backward gets it (`.backward()` would copy one that
    # aliases a leaf's data into .grad).
    (grad,) = torch.autograd.grad((logps * weights[0] + entropy * weights[1]).sum(), logits)
    ended = time.perf_counter()
    del logits, grad, logps, entropy  # the outputs hold the logits through their graph
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
    print("| setting | forward (s) | backward (s) | forward + backward (s) | peak RSS (GiB) |")
    print("|---|---|---|---|---|")
    for name, (chunk, overwrite) in SETTINGS.items():
        out = subprocess.run([sys.executable, "-c", WORKER,
                              json.dumps([args.tokens, args.vocab, args.repeats, chunk, overwrite])],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
        forward, backward, peak_gb = json.loads(out.strip().splitlines()[-1])
        print(f"| {name} | {forward:.3f} | {backward:.3f} | {forward + backward:.3f} | {peak_gb:.2f} |")


if __name__ == "__main__":
    main()
