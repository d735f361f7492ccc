"""Memory of a GRPO step against model size, rollout size and ranks: what fits in 16 and 24 GB.

    python benchmarks/bench_ppo_memory.py [--models 135m,360m] [--rollouts 8x4x64,8x8x128] [--ranks 1,2]
                                          [--switches actor.enable_gradient_checkpointing=true ...]

Models: the embedded SmolLM2-135M-Instruct, and Llama models of SmolLM2-360M's and SmolLM2-1.7B's
shapes with random weights (built in a temporary folder, with the embedded model's tokenizer).
A rollout `PxRxN` is P prompts x R responses x exactly N new tokens (`ignore_eos`). Each run is two
GRPO steps (no KL, one update per rollout) in float32 with the defaults otherwise (or with `--switches`,
RL2 config overrides such as gradient checkpointing), and reports:
- the most resident memory one rank held in each phase of the second step (rollout, update, weight
  sync; the trainer's `perf/*_peak_gb`);
- the most memory all processes held at once over the run (the ranks and the launcher, sampled every
  0.1 s; see `common.tree_memory`), including loading;
- the second step's seconds.
A machine "fits" a run when its peak leaves 1 GB to the system. A run whose weights, gradients, AdamW
state and engine copies alone exceed this machine's memory is not started (the table gives that
least figure); one that fails otherwise (killed for memory) is reported as failed, not retried, and the
script exits 1 after the table, naming it.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from common import run_measured  # noqa: E402

# SmolLM2's shapes (hidden, intermediate, layers, heads, kv heads); the vocabulary is the embedded model's.
SHAPES = {"360m": (960, 2560, 32, 15, 5), "1.7b": (2048, 8192, 24, 32, 32)}


def model_config(name: str):
    """The embedded model's config, or one of SHAPES with its vocabulary."""
    from transformers import AutoConfig

    from RL2.models.default_model import resolve_model_path
    from RL2.native import use_huge_pages

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    config = AutoConfig.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    if name != "135m":
        hidden, intermediate, layers, heads, kv_heads = SHAPES[name]
        config.update({"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
                       "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hidden // heads})
    return config


def n_parameters(config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def least_memory_gb(n_params: int, ranks: int, lora: bool) -> float:
    """What a float32 run needs at least, over all ranks, before any activation: the trainer's weights,
    gradients and AdamW moments (16 bytes a parameter, sharded over the ranks; with LoRA the frozen base's
    4 bytes), and while it rolls out, each rank's engine copy (4 bytes a parameter: the linear layers'
    weights live only in the engine's packed layout; a tied embedding is held twice, which this floor
    leaves out)."""
    return ((4 if lora else 16) * n_params + 4 * n_params * ranks) / 1e9


def trains_lora(switches: list[str]) -> bool:
    return any(s.startswith("actor.lora.rank=") and int(s.split("=", 1)[1]) > 0 for s in switches)


def model_path(name: str, folder: Path) -> str:
    """The embedded model, or a random-weight Llama of one of SHAPES saved under `folder`."""
    if name == "135m":
        return "smollm2-135m-instruct"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from RL2.models.default_model import resolve_model_path
    from RL2.native import use_huge_pages

    use_huge_pages()  # before torch's first CPU allocation here, as RL2's runs do

    path = folder / name
    if not path.exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(model_config(name), dtype=torch.float32).save_pretrained(path)
        AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct")).save_pretrained(path)
    return str(path)


def machine_memory_gb() -> float:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemTotal")) * 1024 / 1e9


def run(model: str, rollout: str, ranks: int, folder: Path, switches: list[str]) -> dict:
    n_prompts, n_responses, new_tokens = (int(x) for x in rollout.split("x"))
    data = folder / f"prompts{n_prompts}.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {2 * i}?", "extra_info": {"answer": str(3 * i)}})
                            + "\n" for i in range(n_prompts)))
    save_dir = folder / f"run-{Path(model).name}-{rollout}-{ranks}"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        "-m", "RL2.trainer.ppo", f"data.train.path={data}", f"data.train.batch_size={n_prompts}", "data.shuffle=false",
        "rollout.env_path=envs/arithmetic.py", f"rollout.responses_per_prompt={n_responses}",
        f"rollout.train_sampling_params.max_new_tokens={new_tokens}", "rollout.train_sampling_params.ignore_eos=true",
        f"actor.model_name={model}", "actor.dtype=float32", "actor.kl.coef=0", "trainer.total_steps=2",
        "trainer.n_epochs=2", f"trainer.save_dir={save_dir}", *switches,
    ]
    try:
        all_processes = run_measured(command, {"WANDB_MODE": "disabled"})
    except subprocess.CalledProcessError as e:
        return {"failed": f"exit code {e.returncode}"}
    last = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()][-1]
    return {"all_processes_gb": all_processes, **{k: v for k, v in last.items() if k.startswith("perf/")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="135m,360m", help="comma-separated, of: 135m, 360m, 1.7b")
    parser.add_argument("--rollouts", default="8x4x64,8x8x128", help="comma-separated PROMPTSxRESPONSESxTOKENS")
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--switches", nargs="*", default=[], help="RL2 config overrides for every run (key=value)")
    args = parser.parse_args()
    # Checked before the first run: a bad entry would otherwise end the grid in a traceback where it comes.
    models, rollouts, ranks_list = args.models.split(","), args.rollouts.split(","), args.ranks.split(",")
    if unknown := [m for m in models if m != "135m" and m not in SHAPES]:
        parser.error(f"--models {args.models}: unknown {unknown}; choose from 135m, {', '.join(SHAPES)}")
    if bad := [r for r in rollouts if not re.fullmatch(r"[1-9][0-9]*x[1-9][0-9]*x[1-9][0-9]*", r)]:
        parser.error(f"--rollouts {args.rollouts}: {bad} not PROMPTSxRESPONSESxTOKENS, three positive integers "
                     "such as 8x4x64")
    if bad := [r for r in ranks_list if not re.fullmatch(r"[1-9][0-9]*", r)]:
        parser.error(f"--ranks {args.ranks}: {bad} not a positive number of ranks")
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in models:
            n_params = n_parameters(model_config(name))
            for rollout in rollouts:
                for ranks in (int(r) for r in ranks_list):
                    least = least_memory_gb(n_params, ranks, trains_lora(args.switches))
                    if least > machine_memory_gb():  # not run: it cannot fit
                        result = {"failed": f"needs at least {least:.0f} GB (weights, gradients, AdamW, engine)"}
                    else:
                        result = run(model_path(name, folder), rollout, ranks, folder, args.switches)
                        if "failed" in result:
                            failed.append(f"{name} {rollout} on {ranks} ranks ({result['failed']})")
                    rows.append((name, rollout, ranks, result))
                    print(json.dumps({"model": name, "rollout": rollout, "ranks": ranks, **result}), flush=True)
    print(f"\nwith {' '.join(args.switches) or 'the defaults'}")
    print("| model | rollout | ranks | rollout GB/rank | update GB/rank | sync GB/rank | all processes GB | "
          "fits 16 GB (< 15) | fits 24 GB (< 23) | s/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rollout, ranks, r in rows:
        if "failed" in r:
            print(f"| {name} | {rollout} | {ranks} | | | | {r['failed']} | no | no | |")
            continue
        total = r["all_processes_gb"]
        print(f"| {name} | {rollout} | {ranks} | {r.get('perf/rollout_peak_gb', 0):.1f} | "
              f"{r.get('perf/actor_update_peak_gb', 0):.1f} | {r.get('perf/sync_peak_gb', 0):.1f} | {total:.1f} | "
              f"{'yes' if total < 15 else 'no'} | {'yes' if total < 23 else 'no'} | {r['perf/step_s']:.0f} |")
    if failed:  # the table is printed whole, but a run that failed is no measurement
        sys.exit(f"failed: {', '.join(failed)} (their output is above)")


if __name__ == "__main__":
    main()
