"""The memory plan's table of docs/gpus.md (and of 24 GiB GPUs, in docs/lora.md): GPU memory of one rank at
each phase of a colocated step, when the trainer and SGLang servers share the GPUs, and the host memory
while the engine samples; docs/gpus.md ("Memory plan") explains the phases and their formulas, with and
without LoRA. The servers' share is the one `RL2.engine.memory_plan` gives them at run time.

    python benchmarks/memory_plan_table.py
"""

from dataclasses import dataclass

import torch

from RL2.config.ppo_schema import COLOCATED_MARGIN_GB
from RL2.engine.memory_plan import COLOCATED_MEM_FRACTION, GIB, ModelShape

# Memory a GPU loses to CUDA contexts and communication buffers of the trainer and the server (for the table).
CONTEXT_BYTES = 2 * GIB


@dataclass
class PhaseMemory:
    """Bytes of one rank at each phase of a colocated step: on its GPU, and on the host while the engine
    samples (see docs/gpus.md)."""

    train: int
    sync: int
    served_weights: int
    kv_cache: int
    host: int  # the trainer's state on the host while the engine samples (page-locked for the run on CUDA)

    @property
    def rollout(self) -> int:
        return self.served_weights + self.kv_cache


def colocated_memory(model: ModelShape, gpu_bytes: int, n_ranks: int, server_tp: int, reference: bool, critic: bool,
                     offload_optimizer: bool = False, lora_params: int = 0) -> PhaseMemory:
    """The memory of one rank at each phase, with the defaults of `rollout.weight_bucket_mb` (512) and
    `rollout.gpu_memory_margin_gb`, and the `mem_fraction_static` RL2 gives the servers.

    Args:
        model: the policy (the critic and reference are the same size).
        gpu_bytes: one GPU's memory.
        n_ranks: ranks that shard the trainer's models (the fsdp degree times cp).
        server_tp: GPUs of one server.
        reference, critic: whether the run has them.
        offload_optimizer: Adam moments live on the CPU between steps.
        lora_params: parameters of the actor's LoRA adapters (`lora_parameters`); 0: every parameter trains.
    """
    p, lora = model.n_params, lora_params > 0
    # Trained parameters: float32 weights and gradients (4 + 4 bytes) and Adam's two moments (8); with
    # offload_optimizer the moments of one model at a time come to the GPU for its optimizer step.
    trained = [lora_params if lora else p] + ([p] if critic else [])
    moments = 8 * (max(trained) if offload_optimizer else sum(trained)) // n_ranks
    frozen = 2 * p // n_ranks if lora or reference else 0  # bf16: a LoRA actor's base, else the reference
    train = 8 * sum(trained) // n_ranks + moments + frozen
    served = 2 * p // server_tp
    bucket = max(512 * 2**20, 2 * model.largest)
    # The actor's weights stay on the GPU for the gather; a LoRA base comes from the CPU a tensor at a time.
    sync = served + 2 * bucket + (2 * model.largest if lora else 4 * p // n_ranks)
    # Offloaded for the rollout: float32 weights and both moments of each trained model (its gradients
    # were freed at the optimizer step) and the bf16 frozen weights.
    host = 12 * sum(trained) // n_ranks + frozen
    kv_cache = int(COLOCATED_MEM_FRACTION * (gpu_bytes - CONTEXT_BYTES)) - int(COLOCATED_MARGIN_GB * GIB) - served
    return PhaseMemory(train=train, sync=sync, served_weights=served, kv_cache=kv_cache, host=host)


def kv_cache_tokens(model: ModelShape, kv_cache_bytes: int, server_tp: int) -> int:
    """Tokens one server's KV cache holds: each GPU keeps its share of the key/value heads."""
    per_gpu = model.kv_bytes_per_token // min(server_tp, model.kv_heads)
    return max(kv_cache_bytes, 0) // per_gpu


def lora_parameters(config, rank: int, targets: list[str] | None = None) -> int:
    """Parameters of the LoRA adapters of rank `rank` on `targets` (default: `actor.lora.target_modules`'s)."""
    from transformers import AutoModelForCausalLM

    from RL2.config.schema import LORA_TARGETS
    from RL2.models.lora import lora_parameters as count

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return count(model, list(model.model.layers), rank, targets or LORA_TARGETS)


def qwen25(size: str) -> ModelShape:
    """Qwen2.5-7B and -32B, from their published configs (no download)."""
    from transformers import Qwen2Config

    shapes = {"7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4),
              "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                          num_key_value_heads=8)}
    config = Qwen2Config(vocab_size=152064, tie_word_embeddings=False, **shapes[size])
    return ModelShape.from_config(config, f"Qwen2.5-{size}")


# The rows of docs/gpus.md's table: (model size, GPUs, server tp, reference, critic, LoRA rank of the actor;
# 0: full training).
README_ROWS = [("7B", 8, 1, False, False, 0), ("7B", 8, 1, True, False, 0), ("7B", 8, 1, True, True, 0),
               ("32B", 8, 2, False, False, 0), ("32B", 8, 2, True, False, 0), ("32B", 8, 2, True, True, 0),
               ("32B", 16, 2, True, True, 0)]
# What fits on 24 GiB GPUs, with LoRA (rank 16 on the attention and MLP projections) and without.
SMALL_GPU_ROWS = [("7B", 1, 1, True, False, 0), ("7B", 1, 1, True, False, 16), ("7B", 2, 1, True, False, 16),
                  ("32B", 4, 4, True, False, 0), ("32B", 4, 4, True, False, 16)]


def readme_table(gpu_gb: int = 80, rows: list[tuple] = README_ROWS) -> str:
    """The table of GPU memory per rank on GPUs of `gpu_gb` GiB, one trainer rank per GPU, and of the host
    memory of a node of up to 8 GPUs."""
    lines = ["| model | GPUs | server tp | trainer models | train | sync | rollout: weights + KV cache | "
             "KV cache tokens / server | host / node |", "|---|---|---|---|---|---|---|---|---|"]
    shapes = {size: qwen25(size) for size in ("7B", "32B")}
    usable = gpu_gb * GIB - CONTEXT_BYTES

    def shown(n_bytes: int) -> str:
        return f"{n_bytes / GIB:.1f} GiB" + (" (does not fit)" if n_bytes > usable else "")

    for size, n_gpus, tp, reference, critic, rank in rows:
        model = shapes[size]
        lora_params = lora_parameters(model.config, rank) if rank else 0
        plan = colocated_memory(model, gpu_gb * GIB, n_gpus, tp, reference, critic, lora_params=lora_params)
        models = "actor" + (f" (LoRA r={rank})" if rank else "") + (" + ref" if reference else "") + (
            " + critic" if critic else "")
        kv = f"{kv_cache_tokens(model, plan.kv_cache, tp) / 1e3:.0f}k" if plan.kv_cache > 0 else "none"
        lines.append(f"| {model.name} ({model.n_params / 1e9:.2f}B) | {n_gpus} | {tp} | {models} | "
                     f"{shown(plan.train)} | {shown(plan.sync)} | "
                     f"{plan.served_weights / GIB:.1f} + {plan.kv_cache / GIB:.1f} GiB | {kv} | "
                     f"{plan.host * min(n_gpus, 8) / GIB:.0f} GiB |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(readme_table())
    print(f"\nOn 24 GiB GPUs:\n{readme_table(24, SMALL_GPU_ROWS)}")
