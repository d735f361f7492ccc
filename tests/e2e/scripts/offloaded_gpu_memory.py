"""Free GPU memory with the trainer's state offloaded, before and after two PPO steps on one GPU.

    python tests/e2e/scripts/offloaded_gpu_memory.py OUT.json MODEL WORKDIR [key=value ...]

Colocated SGLang servers size their KV cache from the memory free when they start, the trainer's
state on the CPU; whatever the trainer's process keeps on the GPU beyond that state and adds later
(kernels loaded at their first launch, cuBLAS workspaces, communicator buffers) comes out of the
memory the servers left free. Here the trainer rolls out with the embedded engine on the same GPU:
its weights stay where they were loaded (each push writes them in place) and its KV cache is emptied
before each measurement, so the free memory lost between the two measurements is the trainer's
process's growth. OUT.json gets both measurements and each step's weight push seconds.
"""

import gc
import json
import sys
from pathlib import Path

import torch

from RL2.config import parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.trainer.ppo import PPOTrainer
from tests.helpers import ENVS


def free_with_state_offloaded(trainer: PPOTrainer) -> int:
    """Bytes free on the trainer's GPU (`torch.cuda.mem_get_info`: the driver's count for the whole
    device) while the actor's parameters, gradients and optimizer state wait on the CPU."""
    worker = trainer.actor.worker
    worker.offload()
    trainer.rollout.engine.runner.cache.clear()
    gc.collect()
    torch.cuda.synchronize(trainer.device)
    torch.cuda.empty_cache()  # blocks the caching allocator keeps are free memory to the servers
    free, _ = torch.cuda.mem_get_info(trainer.device)
    worker.onload()
    return free


def main(out: str, model: str, workdir: str, *overrides: str) -> None:
    work = Path(workdir)
    rows = [{"prompt": f"question {k}", "extra_info": {}} for k in range(8)]
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(PPOConfig, "ppo", [
        f"data.train.path={work / 'train.jsonl'}", "data.train.batch_size=4",
        f"rollout.env_path={ENVS / 'emit_token.py'}",
        "rollout.engine=embedded", "rollout.responses_per_prompt=4", "rollout.train_sampling_params.max_new_tokens=8",
        f"actor.model_name={model}", "actor.dtype=float32", "actor.max_length_per_device=512",
        "trainer.device=cuda", f"trainer.save_dir={work / 'run'}", "trainer.total_steps=2", *overrides])
    trainer = PPOTrainer(cfg)
    before = free_with_state_offloaded(trainer)
    pushes = [trainer.train_step(step)["perf/weight_push_s"] for step in (1, 2)]  # each step ends with its push
    after = free_with_state_offloaded(trainer)
    Path(out).write_text(json.dumps({"free_before": before, "free_after": after, "weight_push_s": pushes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
