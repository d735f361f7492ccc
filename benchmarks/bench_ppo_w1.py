"""Workload W1 for the RL trainer, against TRL's GRPOTrainer on the same workload in the same run.

    python benchmarks/bench_ppo_w1.py [--steps 3] [--nproc 2] [--skip-trl]

W1: the embedded SmolLM2-135M-Instruct, 8 prompts x 4 responses, exactly 64 new tokens each
(`ignore_eos`), no KL, one optimizer step per rollout. `--dtype auto` (the default) is bfloat16 where
the CPU has it natively and float32 elsewhere (emulated bf16 is far slower, for TRL too); TRL runs in
the same dtype (`bf16=True` is its faster mode where bf16 is native). Prints seconds per step split
by phase (medians over the steps after the first), the update phase's achieved FLOP/s against the
matmul peak of that dtype measured in the same run (model FLOPs, 6 x parameters x tokens, as MFU counts
them), the ratio to TRL, and peak resident memory.
TRL is not a dependency of RL2: `pip install trl` to include it.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from common import matmul_peak  # noqa: E402

N_PROMPTS, N_RESPONSES, NEW_TOKENS = 8, 4, 64
PHASES = ("perf/rollout_s", "perf/old_logps_s", "perf/actor_update_s", "perf/sync_s")


def prompts(n: int) -> list[str]:
    return [f"What is {10 + 7 * i % 90} + {23 + 11 * i % 70}? Put the final answer in <answer></answer> tags."
            for i in range(n)]


def matmul_params(model_path: str) -> int:
    """Parameters that take part in a matmul per token (tied embeddings once, as the LM head)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return sum(p.numel() for p in model.parameters() if p.dim() == 2)


def run_rl2(args, data_dir: Path) -> dict:
    rows = [{"prompt": p, "extra_info": {"answer": "0"}} for p in prompts(N_PROMPTS)]
    (data_dir / "w1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_dir = data_dir / "rl2"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        "-m", "RL2.trainer.ppo", f"data.train.path={data_dir / 'w1.jsonl'}", f"data.train.batch_size={N_PROMPTS}",
        "data.shuffle=false", "rollout.env_path=envs/arithmetic.py", f"rollout.responses_per_prompt={N_RESPONSES}",
        f"rollout.train_sampling_params.max_new_tokens={NEW_TOKENS}", "rollout.train_sampling_params.ignore_eos=true",
        "actor.model_name=smollm2-135m-instruct", f"actor.dtype={args.dtype}", "actor.kl.coef=0",
        "actor.update_per_rollout=1", f"trainer.total_steps={args.steps}", f"trainer.n_epochs={args.steps}",
        f"trainer.save_dir={save_dir}",
    ]
    subprocess.run(command, cwd=REPO, check=True, env=os.environ | {"WANDB_MODE": "disabled"})
    steps = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()][1:]  # first: warm-up
    result = {key: statistics.median(m.get(key, 0.0) for m in steps) for key in (*PHASES, "perf/step_s")}
    result["update_tokens"] = statistics.median(m["perf/actor_update_tokens_per_s"] * m["perf/actor_update_s"] for m in steps)
    return result


def run_trl(args, data_dir: Path) -> dict:
    """TRL's GRPOTrainer on W1: the same prompts, group size, 64 forced tokens, no KL, one step per rollout."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from RL2.models.default_model import resolve_model_path

    path = resolve_model_path("smollm2-135m-instruct")
    step_ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())

    def reward(completions, **_):  # cheap, and different across a group so the loss is not zero
        return [float("<answer>" in c[0]["content"]) + 0.01 * len(c[0]["content"]) for c in completions]

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts(N_PROMPTS)] * args.steps)
    config = GRPOConfig(
        output_dir=str(data_dir / "trl"), use_cpu=True, bf16=args.dtype == "bfloat16", max_steps=args.steps,
        per_device_train_batch_size=N_PROMPTS * N_RESPONSES, num_generations=N_RESPONSES,
        max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS}, beta=0.0,
        num_iterations=1, learning_rate=1e-6, logging_steps=1, report_to="none", save_strategy="no",
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(path), callbacks=[Clock()])
    began = time.perf_counter()
    trainer.train()
    times = [b - a for a, b in zip([began, *step_ends], step_ends)][1:]
    return {"perf/step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="RL2 ranks")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 where native, else float32), bfloat16, float32")
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()
    from RL2.models.precision import compute_dtype

    dtype = compute_dtype(args.dtype, torch.device("cpu"))
    args.dtype = str(dtype).removeprefix("torch.")
    torch.set_num_threads(os.cpu_count() or 1)
    peak = matmul_peak(dtype)
    from RL2.models.default_model import resolve_model_path

    n_params = matmul_params(resolve_model_path("smollm2-135m-instruct"))
    with tempfile.TemporaryDirectory() as tmp:
        rl2 = run_rl2(args, Path(tmp))
        rl2_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6
        trl = None if args.skip_trl else run_trl(args, Path(tmp))
    update_flops = 6 * n_params * rl2["update_tokens"] / rl2["perf/actor_update_s"]
    print(f"\nW1 ({N_PROMPTS} prompts x {N_RESPONSES} responses x {NEW_TOKENS} tokens, {args.dtype}); "
          f"{args.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s, median of steps 2..{args.steps}\n")
    print("| system | s/step | rollout s | old logps s | update s | sync s | update GFLOP/s | % of peak | peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| RL2, {args.nproc} ranks | {rl2['perf/step_s']:.1f} | {rl2['perf/rollout_s']:.1f} | "
          f"{rl2['perf/old_logps_s']:.1f} | {rl2['perf/actor_update_s']:.1f} | {rl2['perf/sync_s']:.2f} | "
          f"{update_flops / 1e9:.1f} | {100 * update_flops / peak:.0f}% | {rl2_rss:.1f} GB/rank |")
    if trl:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print(f"| TRL GRPOTrainer ({args.dtype}), 1 process | {trl['perf/step_s']:.1f} | | | | | | | {rss:.1f} GB |")
        print(f"\nRL2 is {trl['perf/step_s'] / rl2['perf/step_s']:.2f}x faster per step than TRL in this run.")


if __name__ == "__main__":
    main()
