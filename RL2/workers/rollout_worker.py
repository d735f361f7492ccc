"""Each rank's inference engine: rollouts of its share of the prompts, and weight syncs from the actor.

Every rank keeps a plain (unsharded) copy of the policy for generation in an `EmbeddedEngine`, rolls
out `prompts[rank::world_size]`, and all-gathers the trajectories, so that every rank ends with
the whole rollout in prompt order (the packing of the update needs the global batch everywhere).
With `rollout.engine=sglang` the engine is a set of SGLang servers instead (see
`RL2/rollout/sglang_engine.py`): every rank still rolls out its share, over HTTP.

Every rollout goes through `RL2.rollout.engine_state.EngineState.sampling`, which makes sure the engine
samples the policy's current weights and, with SGLang servers on the trainer's GPUs, hands the GPU
memory back and forth between them and the trainer's models.
"""

import asyncio
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from RL2.models.embedded import resolve_model_path
from RL2.rollout.client import EngineError
from RL2.rollout.embedded_engine import EmbeddedEngine
from RL2.rewards.reward_fn import load_reward_env
from RL2.rollout.engine_state import EngineState
from RL2.rollout.env import Env, load_env
from RL2.rollout.rollout import partial_rollout_batch, rollout_batch
from RL2.rollout.sglang_engine import SGLangEngine, resolve_engine
from RL2.rollout.trajectory import Trajectory
from RL2.workers.fsdp import FSDPWorker, compute_dtype
from RL2.workers.shared_memory_gather import SharedMemoryGather


def full_tensors(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter of an FSDP2 model, one at a time. Collective.

    Each DTensor is all-gathered on its own, so no rank holds more than one full tensor beyond its
    shards. Shards are cast before the gather, so a bf16 engine moves half the bytes of the float32
    master weights. FSDP2 keeps the HF parameter names, so they match the engine model's state_dict.
    """
    for name, param in model.named_parameters():
        tensor = param.detach().to(dtype)
        if isinstance(tensor, DTensor) and tensor.device.type != tensor.device_mesh.device_type:
            # A shard waiting on the CPU (a LoRA policy's frozen base during a sync) goes to the
            # device of its process group to be gathered, one parameter at a time.
            tensor = DTensor.from_local(tensor.to_local().to(tensor.device_mesh.device_type), tensor.device_mesh,
                                        tensor.placements, shape=tensor.shape, stride=tensor.stride())
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def load_rollout_env(rollout_cfg) -> Env:
    """The environment of a run: `rollout.reward_fn` wrapped as a one-turn environment, else the
    script at `rollout.env_path`."""
    return load_reward_env(rollout_cfg.reward_fn) if rollout_cfg.reward_fn else load_env(rollout_cfg.env_path)


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of one rank at one step: a resumed run samples what the uninterrupted one did."""
    return (seed * 1_000_003 + step) * 1_009 + rank


class RolloutWorker:
    """Args:
        rollout_cfg: the `rollout` config.
        model_cfg: the `actor` config (weights and compute dtype of the engine's copy).
        tokenizer: the policy's tokenizer.
        device: where the engine runs.
        policy: the trained actor whose weights the engine samples from; None: the engine keeps the
            weights it loaded (an evaluation of a fixed model).
        colocated: every model of the trainer on this rank's GPU (the policy included): they move to the
            CPU while SGLang servers launched on the same GPUs sample.
        env: the environment; default: `load_rollout_env(rollout_cfg)` (the Python API passes one).
    """

    def __init__(self, rollout_cfg, model_cfg, tokenizer, device: torch.device, policy: FSDPWorker | None = None,
                 colocated: Sequence[FSDPWorker] = (), env: Env | None = None):
        self.cfg, self.tokenizer, self.device, self.policy = rollout_cfg, tokenizer, device, policy
        self._shared_gather: SharedMemoryGather | bool | None = None  # None: not tried yet; False: not here
        self.dtype = compute_dtype(model_cfg.dtype, device)
        model_path = resolve_model_path(model_cfg.model_name)
        self.sglang = resolve_engine(rollout_cfg, device) == "sglang"
        if self.sglang:
            self.engine = self._start_sglang(rollout_cfg, model_path, list(colocated))
            colocated = colocated if self.engine.colocated else []
        else:
            # Plain sdpa attention: the engine runs its own batched prefill/decode with a KV cache.
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=self.dtype, attn_implementation="sdpa"
            ).to(device).eval()
            self.engine = EmbeddedEngine(self.model, tokenizer, max_running_requests=rollout_cfg.max_running_requests)
            colocated = []
        self.state = EngineState(
            self.engine, policy, self._push_weights, colocated,
            releases_memory=self.sglang and self.engine.colocated,
            follows_policy=policy is not None and not (self.sglang and self.engine.weight_sync == "none"),
        )
        self.state.to_trainer()  # launched GPU servers give their memory to the trainer until the first rollout
        self.env = env if env is not None else load_rollout_env(rollout_cfg)

    def _start_sglang(self, cfg, model_path: str, colocated: list[FSDPWorker]):
        if cfg.server_url:
            return SGLangEngine.connect(cfg, model_path)
        # Servers on the trainer's GPUs size their KV cache from the memory free at their start: the
        # trainer's models wait on the CPU meanwhile (EngineState.to_trainer brings them back).
        for worker in colocated:
            worker.offload()
        engine = SGLangEngine.launch(cfg, model_path, self.dtype, self.device, seed=0)
        if not engine.colocated:
            for worker in colocated:
                worker.onload()
        return engine

    def rollout(self, prompts: list[dict], sampling_params, responses_per_prompt: int, seed: int) -> list[list[Trajectory]]:
        """Roll out this rank's share of `prompts`; returns every rank's groups, in prompt order.

        Args:
            prompts: the global batch of rows (`prompt`, `prompt_ids`, `extra_info`), the same on every rank.
            sampling_params: the sampling config (temperature, top_p, top_k, max_new_tokens).
            responses_per_prompt: trajectories per prompt.
            seed: seeds this rank's sampling (see `rollout_seed`).
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = list(range(rank, len(prompts), world))
        groups = self._on_this_rank(seed, lambda: rollout_batch(
            self.engine, self.env, self.tokenizer, [prompts[i] for i in mine], responses_per_prompt,
            dict(sampling_params), self.cfg.max_turns, self.cfg.max_total_tokens, self.cfg.env_timeout,
        ) if mine else _nothing([]))
        ordered = sorted((pair for part in self._gather(list(zip(mine, groups))) for pair in part), key=lambda p: p[0])
        return [group for _, group in ordered]

    def partial_rollout(
        self, carried: list[list[Trajectory]], prompts: list[dict], sampling_params, responses_per_prompt: int, seed: int,
    ) -> tuple[list[list[Trajectory]], list[list[Trajectory]]]:
        """Partial rollout (`partial_rollout_batch`) of this rank's share of the carried groups and of
        `prompts`, stopping once it has finished as many groups as it got new prompts.

        Returns:
            (finished, unfinished) groups of every rank, the same on every rank.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        my_carried, my_prompts = carried[rank::world], prompts[rank::world]
        n_needed = max(len(my_prompts), 1) if my_carried or my_prompts else 0
        finished, unfinished = self._on_this_rank(seed, lambda: partial_rollout_batch(
            self.engine, self.env, self.tokenizer, my_carried, my_prompts, n_needed, responses_per_prompt,
            dict(sampling_params), self.cfg.max_turns, self.cfg.max_total_tokens, self.cfg.env_timeout,
        ) if n_needed else _nothing(([], [])))
        parts = self._gather((finished, unfinished))
        return [g for part, _ in parts for g in part], [g for _, part in parts for g in part]

    def _on_this_rank(self, seed: int, make_coroutine):
        """Run one rollout coroutine on this rank's engine, seeded; engine errors are raised on every rank."""
        with self.state.sampling():
            # The engine samples with torch's global generator; fork it so the trainer's stream is untouched.
            devices = [self.device] if self.device.type == "cuda" else []
            result, error = None, None
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                try:
                    result = asyncio.run(make_coroutine())
                except EngineError as e:  # reported on every rank below, rather than leaving the others waiting
                    error = f"rank {dist.get_rank()}: {e}"
            errors = [e for e in self._gather(error) if e]
            if errors:
                raise EngineError("the rollout engine failed:\n" + "\n".join(errors))
        return result

    def _gather(self, obj) -> list:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def sync_weights(self, fsdp_model: torch.nn.Module, version: str) -> None:
        """The policy was updated: the engine gets its weights, now or at the start of the next rollout
        (see `EngineState.synced`). Collective.

        Args:
            fsdp_model: the policy's model (the one given at construction).
            version: the name of these weights (the engine reports it as `weight_version`).
        """
        if fsdp_model is not self.policy.model:
            raise ValueError("RolloutWorker.sync_weights takes the policy it was built with")
        self.state.synced(version)

    @torch.no_grad()
    def _push_weights(self, version: str) -> None:
        """Copy the policy's current weights into the engine, parameter by parameter. Collective.

        Ranks on one CPU host exchange their shards through shared memory (set up at the first sync);
        otherwise each parameter is all-gathered on its own. A LoRA policy's weights are merged on the way.
        """
        model = self.policy.model
        if self._shared_gather is None:  # not on GPUs, where a LoRA policy's shards wait on the CPU during a sync
            on_cpu = self.device.type == "cpu"
            self._shared_gather = (on_cpu and SharedMemoryGather.build(model, self.dtype)) or False
        tensors = self._shared_gather.full_tensors() if self._shared_gather else full_tensors(model, self.dtype)
        self.engine.update_weights(self.policy.engine_weights(tensors), weight_version=version)


async def _nothing(value):
    return value
