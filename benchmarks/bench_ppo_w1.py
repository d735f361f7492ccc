"""Workload W1 for the RL trainer, against TRL's GRPOTrainer on the same workload in the same run.

    python benchmarks/bench_ppo_w1.py [--steps 3] [--nproc 2] [--skip-trl] [--variants default,micro-batch-1024]
                                      [--isa avx2] [--rounds 3]

W1: the embedded SmolLM2-135M-Instruct, 8 prompts x 4 responses, exactly 64 new tokens each
(`ignore_eos`), no KL, one optimizer step per rollout. `--dtype auto` (the default) is what RL2's
`dtype=auto` picks: bfloat16 where the CPU's bf16 matmuls are the faster, float32 elsewhere (where bf16
is emulated, or AVX512-BF16 without AMX on an Intel CPU, it is slower, for TRL too); TRL runs in the
same dtype (`bf16=True` is its faster mode where bf16 is the faster).

Prints, from the medians over the steps after the first:
- per phase of an RL2 step (rollout, old log-probs, update, weight sync, the rest): seconds, the
  model FLOPs it must do and their rate against the matmul peak of that dtype measured in the same
  run (the best of rounds before and after the runs), and the most resident memory one rank held in it;
- per system: seconds per step, the speed-up over TRL's faster mode (with or without gradient
  checkpointing, which GRPOConfig turns on by default), and the most memory all of its processes held at
  once (sampled every 0.1 s from the kernel's counters: anonymous memory summed over the processes,
  libraries and the /dev/shm shards the ranks exchange counted once; see `common.tree_memory`), and
  its first step alone (start-up costs: page faults of fresh memory, the kernels' first build);
- the FLOP floor of a step: the rollout's and the update's model FLOPs at the matmul peak;
- a roofline per phase: the most of its FLOP time (at the matmul peak) and its bytes time (the bytes it
  must move at the memory bandwidth measured in the same run), so that what a phase can reach on this
  CPU kind shows (decode, which reads every weight and the KV cache once per step, is memory-bound).
Model FLOPs: of the work W1 needs, each prompt once per group and each sampled token once; 2 per matmul
parameter per token forward, 6 forward and backward; the output projection only where logits are
needed (the sampled tokens). A system that computes a group's prompt once per response does more work
than that, which shows as a lower rate.
Bytes, a lower bound summed over the ranks (which share the memory bus): the rollout reads a rank's
weights once per decode step (a rank decodes its sequences together: W1's 32 requests are within
`rollout.max_running_requests`) and each running sequence's KV cache; the old log-probs read the weights
once a rank; the update reads them three times a rank (forward, and the backward's two products) and
AdamW reads and writes its float32 state (weights, gradients, two moments: 28 bytes a parameter).
`--rounds N` runs every system N times, alternating, for a machine whose speed moves between minutes.
`--variants` runs RL2 again with switches that trade memory for speed (see VARIANTS). `--isa avx2` keeps
both systems (torch, MKL, oneDNN, RL2's C libraries) to AVX2 on an AVX512 host: the code an AVX2 CPU
runs, at this host's clocks and memory speed.
TRL is not a dependency of RL2: `pip install trl` to include it.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from common import add_isa_argument, cpu_kind, matmul_peak, memory_bandwidth, run_measured, run_with_isa  # noqa: E402

# TRL runs with torch's allocator as its users have it: importing RL2 (below) turns huge pages on for
# this process and the ones it starts, unless the caller's environment says otherwise.
TRL_HUGE_PAGES = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")

N_PROMPTS, N_RESPONSES, NEW_TOKENS = 8, 4, 64
PHASES = ("rollout", "old_logps", "actor_update", "sync")
TRL_MODES = ("checkpointing", "no-checkpointing")
# name -> (RL2 command-line overrides, environment)
VARIANTS = {
    "default": ([], {}),
    "no-shared-prefixes": (["actor.share_prefixes=false"], {}),
    "micro-batch-1024": (["actor.max_length_per_device=1024"], {}),
    "micro-batch-512": (["actor.max_length_per_device=512"], {}),
    "checkpointing": (["actor.enable_gradient_checkpointing=true"], {}),
    "checkpointing-every-2": (["actor.enable_gradient_checkpointing=true", "actor.checkpoint_every_n_layers=2"], {}),
    "running-requests-4": (["rollout.max_running_requests=4"], {}),
    "malloc-returns-memory": ([], {"RL2_KEEP_FREED_MEMORY": "0"}),
    "no-huge-pages": ([], {"THP_MEM_ALLOC_ENABLE": "0"}),
    "no-fused-layers": ([], {"RL2_FUSED_LAYERS": "0"}),
}


def prompts(n: int) -> list[str]:
    return [f"What is {10 + 7 * i % 90} + {23 + 11 * i % 70}? Put the final answer in <answer></answer> tags."
            for i in range(n)]


@dataclass(frozen=True)
class ModelShape:
    body: int  # matmul parameters per token of the decoder layers
    head: int  # of the output projection
    params: int  # all parameters (what the optimizer steps)
    kv_per_token: int  # elements of the KV cache a token keeps, over the layers


def model_shape(model_path: str) -> ModelShape:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelShape(
        body=sum(p.numel() for p in model.get_decoder().layers.parameters() if p.dim() == 2),
        head=model.get_output_embeddings().weight.numel(),
        params=sum(p.numel() for p in model.parameters()),
        kv_per_token=config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim,
    )


def run_rl2(args, data_dir: Path, variant: str) -> dict:
    overrides, env = VARIANTS[variant]
    rows = [{"prompt": p, "extra_info": {"answer": "0"}} for p in prompts(N_PROMPTS)]
    (data_dir / "w1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_dir = data_dir / f"rl2-{variant}"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
        "-m", "RL2.trainer.ppo", f"data.train.path={data_dir / 'w1.jsonl'}", f"data.train.batch_size={N_PROMPTS}",
        "data.shuffle=false", "rollout.env_path=envs/arithmetic.py", f"rollout.responses_per_prompt={N_RESPONSES}",
        f"rollout.train_sampling_params.max_new_tokens={NEW_TOKENS}", "rollout.train_sampling_params.ignore_eos=true",
        "actor.model_name=smollm2-135m-instruct", f"actor.dtype={args.dtype}", "actor.kl.coef=0",
        "actor.update_per_rollout=1", f"trainer.total_steps={args.steps}", f"trainer.n_epochs={args.steps}",
        f"trainer.save_dir={save_dir}", *overrides,
    ]
    peak_gb = run_measured(command, {"WANDB_MODE": "disabled", **env})
    first, *steps = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    keys = {key for m in steps for key in m if key.startswith("perf/")} | {"rollout/response_length"}
    result = {key: statistics.median(m.get(key, 0.0) for m in steps) for key in keys}
    result["all_ranks_peak_gb"] = peak_gb
    result["first_step_s"] = first["perf/step_s"]
    return result


def trl_worker(args) -> None:
    """TRL's GRPOTrainer on W1 (the same prompts, group size, 64 forced tokens, no KL, one step per
    rollout), in a process of its own; prints its median seconds per step."""
    import time

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from RL2.models.default_model import resolve_model_path
    from RL2.native import use_huge_pages

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    path = resolve_model_path("smollm2-135m-instruct")
    step_ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())

    def reward(completions, **_):  # cheap, and different across a group so the loss is not zero
        return [float("<answer>" in c[0]["content"]) + 0.01 * len(c[0]["content"]) for c in completions]

    torch.set_num_threads(os.cpu_count() or 1)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts(N_PROMPTS)] * args.steps)
    config = GRPOConfig(
        output_dir=args.trl_worker, use_cpu=True, bf16=args.dtype == "bfloat16", max_steps=args.steps,
        per_device_train_batch_size=N_PROMPTS * N_RESPONSES, num_generations=N_RESPONSES,
        max_completion_length=NEW_TOKENS, generation_kwargs={"min_new_tokens": NEW_TOKENS}, beta=0.0,
        num_iterations=1, learning_rate=1e-6, logging_steps=1, report_to="none", save_strategy="no",
        gradient_checkpointing=args.trl_mode == "checkpointing",
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(path), callbacks=[Clock()])
    began = time.perf_counter()
    trainer.train()
    first, *times = [b - a for a, b in zip([began, *step_ends], step_ends)]
    print(json.dumps({"perf/step_s": statistics.median(times), "first_step_s": first}))


def run_trl(args, data_dir: Path, mode: str) -> dict:
    out = data_dir / f"trl-{mode}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(data_dir / f"trl-{mode}"),
               "--steps", str(args.steps), "--dtype", args.dtype, "--trl-mode", mode]
    with open(out, "w") as f:
        peak_gb = run_measured(command, {"THP_MEM_ALLOC_ENABLE": TRL_HUGE_PAGES}, stdout=f)
    result = json.loads(out.read_text().strip().splitlines()[-1])
    result["all_ranks_peak_gb"] = peak_gb
    return result


def prompt_tokens(model_path: str) -> int:
    """Tokens of W1's prompts through the chat template, each prompt once."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return sum(len(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"])
               for p in prompts(N_PROMPTS))


@dataclass(frozen=True)
class Machine:
    peak: float  # FLOP/s of the run's dtype's matmuls
    bandwidth: float  # bytes/s read from memory
    ranks: int
    dtype_bytes: int


def phase_work(rl2: dict, shape: ModelShape, machine: Machine, prompt_work: int) -> dict[str, tuple[float, float]]:
    """Each phase's (model FLOPs, bytes moved), as the module's docstring counts them."""
    sampled = rl2["rollout/response_length"] * N_PROMPTS * N_RESPONSES
    tokens = prompt_work + sampled
    forward = 2 * (shape.body * tokens + shape.head * sampled)  # logits of the sampled tokens only
    weights = (shape.body + shape.head) * machine.dtype_bytes * machine.ranks
    steps = rl2["rollout/response_length"]
    kv_tokens = N_PROMPTS * N_RESPONSES * (steps * prompt_work / N_PROMPTS + steps * (steps + 1) / 2)
    old_logps = bool(rl2.get("perf/old_logps_s"))
    return {
        "rollout": (forward, steps * weights + kv_tokens * shape.kv_per_token * machine.dtype_bytes),
        "old_logps": (forward if old_logps else 0, weights if old_logps else 0),
        "actor_update": (3 * forward, 3 * weights + 28 * shape.params),
        "sync": (0, 0),
    }


def phase_table(rl2: dict, shape: ModelShape, machine: Machine, prompt_work: int) -> None:
    """Print the per-phase table of one RL2 run, with the step's FLOP floor and roofline."""
    work = phase_work(rl2, shape, machine, prompt_work)
    roofline = {phase: max(flops / machine.peak, moved / machine.bandwidth) for phase, (flops, moved) in work.items()}
    step_s = rl2["perf/step_s"]
    other_s = step_s - sum(rl2.get(f"perf/{phase}_s", 0.0) for phase in PHASES)
    print("| phase | s | share of step | model TFLOP | GFLOP/s | % of matmul peak | GB moved | roofline s | "
          "% of roofline | peak RSS of a rank (GB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for phase in PHASES:
        seconds = rl2.get(f"perf/{phase}_s")
        if not seconds:
            continue
        flops, moved = work[phase]
        rate = flops / seconds
        of_roofline = f"{roofline[phase] / seconds:.0%}" if roofline[phase] else ""  # the sync: neither FLOPs nor model
        print(f"| {phase} | {seconds:.2f} | {seconds / step_s:.0%} | {flops / 1e12:.2f} | {rate / 1e9:.0f} | "
              f"{rate / machine.peak:.0%} | {moved / 1e9:.1f} | {roofline[phase]:.2f} | {of_roofline} | "
              f"{rl2.get(f'perf/{phase}_peak_gb', 0.0):.2f} |")
    push_s = rl2.get("perf/weight_push_s", 0.0) + rl2.get("perf/rollout_weight_push_s", 0.0)
    blank = " |" * 7
    print(f"| of which weight push (in the sync, or the rollout) | {push_s:.2f} | {push_s / step_s:.0%} |{blank}")
    print(f"| other (advantages, logging, gathers) | {other_s:.2f} | {other_s / step_s:.0%} |{blank}")
    floor = (work["rollout"][0] + work["actor_update"][0]) / machine.peak
    bound = sum(roofline.values())
    print(f"\nFLOP floor of a step (rollout + update at the matmul peak): {floor:.1f} s; roofline of a step (each "
          f"phase at the slower of its FLOP and bytes times): {bound:.1f} s; this run took {step_s:.1f} s "
          f"({floor / step_s:.0%} of the floor's speed, {bound / step_s:.0%} of the roofline's).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times, alternating, and report each round's speed-ups")
    parser.add_argument("--nproc", type=int, default=2, help="RL2 ranks")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto (bfloat16 where native, else float32), bfloat16, float32")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--variants", default="default", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--trl-modes", default="checkpointing,no-checkpointing",
                        help="TRL runs: checkpointing (GRPOConfig's default) and/or no-checkpointing")
    add_isa_argument(parser)
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--trl-mode", default="checkpointing", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: give at least 2; the tables are medians of the steps after the first, "
                     "which also starts up")
    run_with_isa(args.isa)  # before RL2 is imported: TRL gets the caller's huge-page setting
    if args.trl_worker:
        return trl_worker(args)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if bad := [m for m in args.trl_modes.split(",") if m not in TRL_MODES]:
        parser.error(f"--trl-modes {args.trl_modes}: unknown {bad}; choose from {', '.join(TRL_MODES)}")
    if not args.skip_trl and importlib.util.find_spec("trl") is None:  # else RL2's runs end in TRL's ImportError
        parser.error("TRL is not installed: `pip install trl` to compare with it, or pass --skip-trl")
    from RL2.models.default_model import resolve_model_path
    from RL2.models.precision import compute_dtype
    from RL2.native import use_huge_pages

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    dtype = compute_dtype(args.dtype, torch.device("cpu"))
    args.dtype = str(dtype).removeprefix("torch.")
    torch.set_num_threads(os.cpu_count() or 1)
    peak, bandwidth = matmul_peak(dtype), memory_bandwidth()
    shape = model_shape(resolve_model_path("smollm2-135m-instruct"))
    prompt_work = prompt_tokens(resolve_model_path("smollm2-135m-instruct"))
    speedups = []
    for round_index in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            runs = {variant: run_rl2(args, Path(tmp), variant) for variant in variants}
            trl = {} if args.skip_trl else {mode: run_trl(args, Path(tmp), mode) for mode in args.trl_modes.split(",")}
        # Measured before and after the runs: a busy moment lowers one.
        peak, bandwidth = max(peak, matmul_peak(dtype)), max(bandwidth, memory_bandwidth())
        machine = Machine(peak, bandwidth, args.nproc, dtype.itemsize)
        title = f"round {round_index + 1} of {args.rounds}: " if args.rounds > 1 else ""
        print(f"\n{title}W1 ({N_PROMPTS} prompts x {N_RESPONSES} responses x {NEW_TOKENS} tokens, {args.dtype}, RL2 "
              f"on {args.nproc} ranks, {args.isa} instructions); {args.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s; "
              f"memory bandwidth {bandwidth / 1e9:.1f} GB/s; medians of steps 2..{args.steps}; {cpu_kind()}")
        speedups.append(report(args, runs, trl, shape, machine, prompt_work))
    if args.rounds > 1 and not args.skip_trl:
        for variant in variants:
            ratios = [round_speedups[variant] for round_speedups in speedups]
            print(f"\nRL2 {variant} over TRL's faster mode, round by round: "
                  f"{', '.join(f'{r:.2f}x' for r in ratios)}; median {statistics.median(ratios):.2f}x")


def report(args, runs: dict, trl: dict, shape: ModelShape, machine: Machine, prompt_work: int) -> dict[str, float]:
    """Print one round's tables; returns each RL2 variant's speed-up over TRL's faster mode (none without TRL)."""
    for variant, rl2 in runs.items():
        print(f"\nRL2 {variant}:\n")
        phase_table(rl2, shape, machine, prompt_work)
    # Speed-ups are over TRL's faster mode.
    fastest = min((run["perf/step_s"] for run in trl.values()), default=None)
    speedups = {variant: fastest / rl2["perf/step_s"] for variant, rl2 in runs.items()} if fastest else {}
    print("\n| system | s/step | speed-up over TRL's faster mode | first step (s) | peak memory, all processes (GB) | "
          "peak RSS of a rank (GB) |")
    print("|---|---|---|---|---|---|")
    for variant, rl2 in runs.items():
        ratio = f"{speedups[variant]:.2f}x" if fastest else ""
        print(f"| RL2 {variant} | {rl2['perf/step_s']:.1f} | {ratio} | {rl2['first_step_s']:.1f} | "
              f"{rl2['all_ranks_peak_gb']:.2f} | {rl2.get('perf/peak_gb', 0.0):.2f} |")
    for mode, run in trl.items():
        print(f"| TRL GRPOTrainer ({args.dtype}, {mode.replace('-', ' ')}), 1 process | {run['perf/step_s']:.1f} | "
              f"{fastest / run['perf/step_s']:.2f}x | {run['first_step_s']:.1f} | {run['all_ranks_peak_gb']:.2f} | |")
    return speedups


if __name__ == "__main__":
    main()
