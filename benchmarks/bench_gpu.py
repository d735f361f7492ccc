"""SFT and the PPO update on one GPU: RL2 against Hugging Face's Trainer on the same GPU, in the same run.

    python benchmarks/bench_gpu.py [--size 0.5B|1.5B] [--steps 5] [--seqs 64] [--min-len 128] [--max-len 1024]

The model is Qwen2.5-shaped with random weights, built from its published config (nothing is
downloaded), saved once in float32 and loaded by every system: bf16 compute over float32 master
weights, AdamW, clipping at norm 1, one optimizer step per batch of `--seqs` sequences of random
lengths and random tokens (the same batch every step).
- sft: RL2's `FSDPWorker` on packed micro-batches of `--max-tokens` tokens, against `transformers.Trainer`
  on padded batches (`--hf-batch` sequences a pass, gradient accumulation to the same batch, sdpa
  attention, `group_by_length` to keep padding low), the loss on the last 90% of every sequence.
- ppo: RL2's `Actor.update` (clipped policy loss on the response tokens, the second half of every
  sequence, logits only where trained), against the same loss in `Trainer.compute_loss` on padded
  batches (log-probs by logsumexp, as TRL computes them).
Each system runs in a process of its own. Per system: seconds per step (median after a warm-up step),
tokens/s (real tokens, padding not counted), model FLOP/s (6 x matmul parameters x tokens plus causal
attention, the same count for both), MFU against the GPU's dense bf16 peak (its datasheet figure when
the GPU is known, else the bf16 matmul rate measured here), and peak GPU memory.
Needs torch with CUDA, transformers and accelerate; no omegaconf, datasets or wandb.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# Dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s), by a substring of the device name.
BF16_PEAKS = {"H200": 989.4e12, "H100 PCIe": 756.5e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362.1e12,
              "A10G": 70e12, "L4": 121e12}
QWEN25 = {"0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, tie_word_embeddings=True),
          "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, tie_word_embeddings=True)}
# A tiny shape for `--device cpu`, a check of the script itself.
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=True)
VOCAB = 151_936
LR = 1e-5


def bf16_peak() -> tuple[float, str]:
    name = torch.cuda.get_device_name()
    for key, peak in BF16_PEAKS.items():
        if key in name:
            return peak, "datasheet"
    return measured_matmul_rate(), "measured"


def measured_matmul_rate(n: int = 8192, repeats: int = 20) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - began)


def make_model(size: str, folder: Path) -> int:
    """Save a random-weight Qwen2.5-shaped model to `folder`; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = QWEN25[size] if size in QWEN25 else SMOKE_SHAPE
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, max_position_embeddings=32768, **shape))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def batch(args, workload: str) -> list[dict]:
    """The sequences of every step: random lengths and tokens; the first tenth (sft) or half (ppo)
    of each untrained."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.seqs,), generator=generator).tolist()
    rows = []
    for n in lengths:
        prompt = n // 10 if workload == "sft" else n // 2
        rows.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=generator).tolist(),
                     "loss_mask": [0] * prompt + [1] * (n - prompt),
                     "advantage": float(torch.randn(1, generator=generator))})
    return rows


def model_flops(config, rows: list[dict]) -> float:
    """Forward and backward (3 x forward): 2 FLOPs per matmul parameter per token, plus causal attention
    scores and values; the input embedding is a lookup, the (tied) LM head a matmul."""
    h, layers = config.hidden_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * config.intermediate_size
    matmul = layers * per_layer + VOCAB * h
    tokens = [len(r["input_ids"]) - 1 for r in rows]
    attention = sum(2 * 2 * layers * h * n * n / 2 for n in tokens)
    return 3 * (2 * matmul * sum(tokens) + attention)


# ---- workers (one process each) ----------------------------------------------------------------------


def actor_config(args):
    """The actor's config with the schema's defaults (`ActorConfig` is a plain dataclass: no omegaconf needed)."""
    from RL2.config.ppo_schema import ActorConfig

    cfg = ActorConfig(model_name=args.model, dtype="bfloat16" if args.device == "cuda" else "float32",
                      max_length_per_device=args.max_tokens, enable_gradient_checkpointing=args.checkpointing)
    cfg.optimizer.lr = LR
    return cfg


def rl2_worker(args) -> dict:
    from RL2.batch import RolloutBatch, SequenceBatch
    from RL2.models.logps import packed_logps
    from RL2.native import use_huge_pages
    from RL2.packing import pack, train_weights
    from RL2.parallel import ParallelDims, init_distributed, pick_device
    from RL2.workers.actor import Actor
    from RL2.workers.fsdp import FSDPWorker

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    device = pick_device(args.device)
    init_distributed(device)
    dims = ParallelDims(1, device_type=device.type)
    cfg, rows = actor_config(args), batch(args, args.workload)
    if args.workload == "sft":
        worker = FSDPWorker(cfg, dims, device, total_steps=args.steps + 1)
        sequences = SequenceBatch.from_examples(rows)
        micro_batches = [mb.to(device)
                         for mb in pack(sequences, 0, 1, args.max_tokens, train_weights(sequences, "token"))]

        def step():
            for mb in micro_batches:
                worker.backward(-(packed_logps(worker.model, mb) * mb.loss_weights).sum())
            worker.optimizer_step()
    else:
        actor = Actor(cfg, dims, device, total_steps=args.steps + 1)
        rollout = RolloutBatch.single_turn(
            [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "engine_logps": [0.0] * len(r["input_ids"]),
              "advantages": [r["advantage"] * m for m in r["loss_mask"]]} for r in rows], list(range(len(rows))))

        def step():
            actor.update(rollout)
    model = (worker if args.workload == "sft" else actor.worker).model
    result = timed_steps(step, args.steps, model.config, rows, device)
    if args.profile:
        profile_step(step, device, Path(args.profile) / f"rl2_{args.workload}.txt")
    return result


def profile_step(step, device: torch.device, path: Path) -> None:
    """One more step under torch.profiler: its operators by their own time on the device (on the CPU without
    a GPU), the 30 costliest, into `path`: where the step's time goes when a figure falls short."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")


def hf_worker(args) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    rows = batch(args, args.workload)
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_trained = sum(sum(r["loss_mask"][1:]) for r in rows)
    dataset = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "advantage": r["advantage"]} for r in rows]

    def collate(items: list[dict]) -> dict:
        width = max(len(x["input_ids"]) for x in items)
        pad = lambda key, value: torch.tensor([x[key] + [value] * (width - len(x[key])) for x in items])
        return {"input_ids": pad("input_ids", 0), "loss_mask": pad("loss_mask", 0).float(),
                "attention_mask": torch.tensor([[1] * len(x["input_ids"]) + [0] * (width - len(x["input_ids"]))
                                                for x in items]),
                "advantage": torch.tensor([x["advantage"] for x in items])}

    class TokenMeanLoss(Trainer):
        """The loss of the global batch as a mean over its trained tokens, like RL2's avg_level=token."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids = inputs["input_ids"]
            logits = model(input_ids=ids, attention_mask=inputs["attention_mask"]).logits[:, :-1]
            labels, mask = ids[:, 1:], inputs["loss_mask"][:, 1:]
            logps = logits.gather(-1, labels[..., None])[..., 0].float() - logits.float().logsumexp(-1)
            if args.workload == "sft":
                losses = -logps
            else:  # PPO's clipped surrogate; one step per rollout, so the old policy is the current one
                ratio = torch.exp(logps - logps.detach())
                advantage = inputs["advantage"][:, None]
                losses = -torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
            # Trainer divides by the accumulation steps; undo it so that the batch's loss is the token mean.
            return (losses * mask).sum() / n_trained * self.args.gradient_accumulation_steps

    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            synchronize(device)
            times.append(-time.perf_counter())

        def on_step_end(self, *_, **__):
            synchronize(device)
            times[-1] += time.perf_counter()

    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.hf_batch,
            gradient_accumulation_steps=args.seqs // args.hf_batch, max_steps=args.steps + 1, learning_rate=LR,
            lr_scheduler_type="constant", max_grad_norm=1.0, bf16=device.type == "cuda", optim="adamw_torch_fused",
            weight_decay=0.0, save_strategy="no", report_to=[], logging_strategy="no", disable_tqdm=True,
            remove_unused_columns=False, dataloader_num_workers=0, seed=0, use_cpu=device.type == "cpu",
            **length_grouping(TrainingArguments))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        TokenMeanLoss(model=model, args=training, train_dataset=dataset, data_collator=collate,
                      callbacks=[Timer()]).train()
    return summary(times, model.config, rows, device)


def length_grouping(training_arguments) -> dict:
    """Trainer's batches of similar lengths (less padding): `group_by_length` became
    `train_sampling_strategy` in transformers 5."""
    names = {f.name for f in dataclasses.fields(training_arguments)}
    if "train_sampling_strategy" in names:
        return {"train_sampling_strategy": "group_by_length"}
    return {"group_by_length": True} if "group_by_length" in names else {}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(step, steps: int, config, rows: list[dict], device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps + 1):  # the first step warms up
        synchronize(device)
        began = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - began)
    return summary(times, config, rows, device)


def summary(times: list[float], config, rows: list[dict], device: torch.device) -> dict:
    step_s = statistics.median(times[1:])
    tokens = sum(len(r["input_ids"]) for r in rows)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return {"step_s": step_s, "tokens_per_s": tokens / step_s, "flops_per_s": model_flops(config, rows) / step_s,
            "peak_gb": peak, "steps": len(times) - 1}


# ---- the run ------------------------------------------------------------------------------------------


def run_worker(system: str, workload: str, args, model: Path) -> dict | str:
    cmd = [sys.executable, __file__, "--worker", system, "--workload", workload, "--model", str(model),
           f"--device={args.device}",
           f"--steps={args.steps}", f"--seqs={args.seqs}", f"--min-len={args.min_len}", f"--max-len={args.max_len}",
           f"--max-tokens={args.max_tokens}", f"--hf-batch={args.hf_batch}"] + (
        ["--checkpointing"] if args.checkpointing else []) + ([f"--profile={args.profile}"] if args.profile else [])
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        return f"failed: {(result.stderr or result.stdout).strip().splitlines()[-1][:150]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["rl2", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", choices=["sft", "ppo"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(QWEN25), default="0.5B")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seqs", type=int, default=64, help="sequences per optimizer step")
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16384,
                        help="RL2's micro-batch budget (max_length_per_device)")
    parser.add_argument("--hf-batch", type=int, default=8,
                        help="Trainer's sequences per forward (per_device_train_batch_size)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing in both systems")
    parser.add_argument("--profile", metavar="DIR", help="after the timed steps, profile one RL2 step of each "
                        "workload into DIR/rl2_<workload>.txt (operators by their own time)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a check of this script with a tiny model, no figures")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU")
    if args.worker:
        print(json.dumps((rl2_worker if args.worker == "rl2" else hf_worker)(args)))
        return
    if args.seqs % args.hf_batch:
        sys.exit("--seqs must be a multiple of --hf-batch (Trainer accumulates whole batches)")
    if args.device == "cuda":
        peak, source = bf16_peak()
        print(f"GPU: {torch.cuda.get_device_name()}, bf16 dense peak {peak / 1e12:.0f} TFLOP/s ({source}); "
              f"torch {torch.__version__}")
    else:
        peak, args.size = float("inf"), "smoke"
    failed = []
    with tempfile.TemporaryDirectory() as folder:
        n_params = make_model(args.size, Path(folder))
        tokens = sum(len(r["input_ids"]) for r in batch(args, "sft"))
        print(f"model: Qwen2.5-{args.size}-shaped, {n_params / 1e6:.0f}M parameters, random weights; "
              f"{args.seqs} sequences of {args.min_len}-{args.max_len} tokens ({tokens} tokens) per step, "
              f"median of {args.steps} steps after one warm-up")
        header = f"{'workload':<9}{'system':<12}{'step s':>8}{'tokens/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'peak GiB':>10}"
        print(header + "\n" + "-" * len(header))
        for workload in ("sft", "ppo"):
            results = {}
            for system, label in (("rl2", "RL2"), ("hf", "HF Trainer")):
                r = run_worker(system, workload, args, Path(folder))
                results[system] = r
                if isinstance(r, str):
                    print(f"{workload:<9}{label:<12}{r}", flush=True)
                    failed.append(f"{workload} {label}")
                    continue
                print(f"{workload:<9}{label:<12}{r['step_s']:>8.3f}{r['tokens_per_s']:>10.0f}"
                      f"{r['flops_per_s'] / 1e12:>9.1f}{100 * r['flops_per_s'] / peak:>6.1f}%{r['peak_gb']:>10.1f}",
                      flush=True)
            if all(isinstance(r, dict) for r in results.values()):
                rl2, hf = results["rl2"], results["hf"]
                memory = f", {rl2['peak_gb'] / hf['peak_gb']:.2f}x the peak memory" if hf["peak_gb"] else ""
                print(f"{workload:<9}RL2: {hf['step_s'] / rl2['step_s']:.2f}x HF Trainer's tokens/s{memory}")
    if failed:  # the table is printed whole, but a run with a failed system is no measurement
        sys.exit(f"failed: {', '.join(failed)} (the worker's last line is in its row)")


if __name__ == "__main__":
    main()
