"""Each rank's inference engine: rollouts of its share of the prompts, and weight syncs from the actor.

Every rank keeps a plain (unsharded) copy of the policy for generation in an `EmbeddedEngine` (or, with
`rollout.engine=sglang`, talks to SGLang servers over HTTP: `RL2/engine/sglang/engine.py`), rolls out
`prompts[rank::world_size]`, and all-gathers the trajectories, so that every rank ends with the whole
rollout in prompt order (the packing of the update needs the global batch everywhere).

Whether the engine may sample is decided in one place, `RL2.rollout.engine_state.EngineState`.
"""

import asyncio
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from RL2.agents.tool_calls import tool_call_parser
from RL2.agents.tool_use import tool_use_of
from RL2.agents.tools import template_renders_tools
from RL2.engine import start_engine
from RL2.engine.protocol import EngineError
from RL2.models.default_model import resolve_model_path
from RL2.models.precision import compute_dtype
from RL2.native import SharedMemoryGather, shared_weight_gather
from RL2.rollout.engine_state import EngineState
from RL2.rollout.env import Env, EnvError, load_env
from RL2.rollout.event_loop import run_on_rank_loop
from RL2.rollout.loop import partial_rollout_batch, rollout_batch
from RL2.rollout.reward_env import load_reward_env
from RL2.rollout.trajectory import Trajectory, weight_version_number
from RL2.sandbox import run_sandbox, use_sandbox


def context_length(model_path: str, server_args) -> int | None:
    """The most tokens a served sequence may hold: SGLang's `context_length` flag, else the model's
    `max_position_embeddings` (None when its config has none)."""
    if server_args and server_args.get("context_length"):
        return int(server_args["context_length"])
    return getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)


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


def is_agent(env) -> bool:
    """Whether what `load_rollout_env` gave is an agent script (`RL2.agents.agent.Agent`): anything that is not
    an environment. (The agent's modules, which need openai and aiohttp, are imported only for agents.)"""
    return not isinstance(env, Env)


def load_rollout_env(rollout_cfg):
    """The environment of a run: `rollout.reward_fn` wrapped as a one-turn environment, the agent script
    at `rollout.agent_path`, else the script at `rollout.env_path`; an error names the key
    (`load_reward_env`'s name rollout.reward_fn)."""
    if rollout_cfg.reward_fn:
        return load_reward_env(rollout_cfg.reward_fn)
    if rollout_cfg.get("agent_path"):
        from RL2.agents.agent import load_agent

        try:
            return load_agent(rollout_cfg.agent_path)
        except EnvError as e:
            raise EnvError(f"rollout.agent_path={rollout_cfg.agent_path}: {e}") from None
    if not rollout_cfg.env_path:  # no default: a run must say what scores it
        raise EnvError("rollout.env_path is not set; give the environment script that scores the actions, e.g. "
                       "rollout.env_path=envs/arithmetic.py (or rollout.reward_fn=FILE:NAME, rollout.agent_path=FILE)")
    try:
        return load_env(rollout_cfg.env_path)
    except EnvError as e:
        raise EnvError(f"rollout.env_path={rollout_cfg.env_path}: {e}") from None


def engine_sampling_params(params) -> dict:
    """A sampling config (`rollout.*_sampling_params`, or a plain dict) as the engines' `/generate` params.

    Stop strings become a list (a single string is one stop). `no_stop_trim` is left out: it only trims
    the engines' text, and the rollout decodes the sampled tokens itself (an action keeps its stop string).
    """
    params = dict(params.items())  # a config section holds lists as its own list type: made plain below
    params.pop("no_stop_trim", None)
    stop = params.pop("stop", None)
    if stop:
        params["stop"] = [stop] if isinstance(stop, str) else [str(s) for s in stop]
    stop_token_ids = params.pop("stop_token_ids", None)
    if stop_token_ids:
        params["stop_token_ids"] = [int(token) for token in stop_token_ids]
    return params


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """Sampling seed of one rank at one step: a resumed run samples what the uninterrupted one did."""
    return (seed * 1_000_003 + step) * 1_009 + rank


class RolloutWorker:
    """Args:
        rollout_cfg: the `rollout` config.
        model_cfg: the `actor` config (weights and compute dtype of the engine's copy).
        tokenizer: the policy's tokenizer.
        device: where the engine runs.
        policy: the trained actor (an `FSDPWorker`) whose weights the engine samples from; None: the
            engine keeps the weights it loaded (an evaluation of a fixed model).
        colocated: every model (`FSDPWorker`) of the trainer on this rank's GPU, the policy included:
            they move to the CPU while SGLang servers launched on the same GPUs sample.
        env: the environment; default: `load_rollout_env(rollout_cfg)` (the Python API passes one).
        seed: the run's seed, for the engine's own sampling stream (see `start_engine`).
    """

    def __init__(self, rollout_cfg, model_cfg, tokenizer, device: torch.device, policy=None, colocated: Sequence = (),
                 env: Env | None = None, seed: int = 0):
        self.cfg, self.tokenizer, self.device, self.policy = rollout_cfg, tokenizer, device, policy
        self._shared_gather: SharedMemoryGather | bool | None = None  # None: not tried yet; False: not here
        self.dtype = compute_dtype(model_cfg.dtype, device)
        self.engine = start_engine(rollout_cfg, resolve_model_path(model_cfg.model_name), self.dtype, device,
                                   tokenizer, colocated, seed)
        self.push_seconds = 0.0  # spent pushing weights since `take_push_seconds` last read it
        # The trainer's models move off only for an engine that releases GPU memory (on CPU, offloading is
        # nothing and the embedded engine's pushes need not wait for it).
        shares_gpu = self.engine.releases_memory and device.type == "cuda"
        self.state = EngineState(self.engine, policy, self._push_weights, colocated if shares_gpu else [])
        self.state.to_trainer()  # launched GPU servers give their memory to the trainer until the first rollout
        self.env = env if env is not None else load_rollout_env(rollout_cfg)
        # The sandbox of the environment's code rewards (made at its first use), entered for each rollout.
        self.sandbox = run_sandbox(bool(rollout_cfg.get("code_sandbox_unisolated", False)))
        self.tool_use = tool_use_of(self.env, rollout_cfg, tokenizer)
        # Unset, a sequence may grow to the model's context: a request past it is refused (by SGLang and
        # the embedded engine alike), which would fail the rollout, where the budget ends one trajectory.
        self.max_total_tokens = rollout_cfg.max_total_tokens or context_length(
            resolve_model_path(model_cfg.model_name), rollout_cfg.server_args)
        self.endpoint = None
        if is_agent(self.env):  # its calls reach this rank's engine through an OpenAI endpoint
            from RL2.agents.openai_server import OpenAIEndpoint

            parser = tool_call_parser(rollout_cfg.tool_parser, tokenizer)
            self.endpoint = OpenAIEndpoint(self.engine, tokenizer, parser, template_renders_tools(tokenizer), {},
                                           self.max_total_tokens, rollout_cfg.tool_call_stop)

    @property
    def uses_tools(self) -> bool:
        """The policy may call tools: the rollout's tool metrics mean something."""
        return self.tool_use is not None or self.endpoint is not None

    def rollout(self, prompts: list[dict], sampling_params, responses_per_prompt: int, seed: int) -> list[list[Trajectory]]:
        """Roll out this rank's share of `prompts`; returns every rank's groups, in prompt order.

        Args:
            prompts: the global batch of rows (`prompt`, `prompt_ids`, `extra_info`), the same on every rank.
            sampling_params: the sampling config (temperature, top_p, top_k, max_new_tokens, stop, ...).
            responses_per_prompt: trajectories per prompt.
            seed: seeds this rank's sampling (see `rollout_seed`).
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = list(range(rank, len(prompts), world))
        groups = self._on_this_rank(seed, lambda: self._rollout_batch(
            [prompts[i] for i in mine], self._sampling_params(sampling_params), responses_per_prompt,
        ) if mine else asyncio.sleep(0, []))
        self._fill_versions(groups)
        ordered = sorted((pair for part in self._gather(list(zip(mine, groups))) for pair in part), key=lambda p: p[0])
        return [group for _, group in ordered]

    def partial_rollout(
        self, carried: list[list[Trajectory]], prompts: list[dict], sampling_params, responses_per_prompt: int, seed: int,
        n_needed: int | None = None,
    ) -> tuple[list[list[Trajectory]], list[list[Trajectory]], list[list[Trajectory]]]:
        """Partial rollout (`partial_rollout_batch`) of this rank's share of the carried groups and of
        `prompts`, each rank stopping once it has finished its share of `n_needed` groups (at least one;
        default: one per prompt; fewer than the groups started, `rollout.over_sampling`, cuts the slowest).
        Returns the (finished, unfinished, newly finished) groups of every rank, the same on every rank.
        """
        rank, world = dist.get_rank(), dist.get_world_size()
        my_carried, my_prompts = carried[rank::world], prompts[rank::world]
        total = len(prompts) if n_needed is None else n_needed
        my_needed = max(len(range(rank, total, world)), 1) if my_carried or my_prompts else 0
        result = self._on_this_rank(seed, lambda: partial_rollout_batch(
            self.engine, self.env, self.tokenizer, my_carried, my_prompts, my_needed, responses_per_prompt,
            self._sampling_params(sampling_params), self.cfg.max_turns, self.max_total_tokens, self.cfg.env_timeout,
            self.tool_use, self.cfg.max_consecutive_timeouts,
        ) if my_needed else asyncio.sleep(0, ([], [], [])))
        self._fill_versions(result[0] + result[1])
        parts = self._gather(result)
        return tuple([g for part in parts for g in part[i]] for i in range(3))

    def _rollout_batch(self, prompts: list[dict], sampling_params: dict, responses_per_prompt: int):
        """The coroutine rolling out `prompts` on this rank: an agent's runs, or environment trajectories."""
        if self.endpoint is not None:
            from RL2.agents.agent import agent_rollout_batch

            self.endpoint.default_sampling = sampling_params
            return agent_rollout_batch(self.endpoint, self.env, prompts, responses_per_prompt, self.cfg.agent_timeout,
                                       self.cfg.max_consecutive_timeouts)
        return rollout_batch(self.engine, self.env, self.tokenizer, prompts, responses_per_prompt, sampling_params,
                             self.cfg.max_turns, self.max_total_tokens, self.cfg.env_timeout, self.tool_use,
                             self.cfg.max_consecutive_timeouts)

    def _fill_versions(self, groups: list[list[Trajectory]]) -> None:
        """Tokens sampled without the engine naming its weights (an SGLang server older than its
        `weight_version`) get the version of the weights this rollout sampled with."""
        version = weight_version_number(self.state.label) if self.state.follows_policy else 0
        if version is not None:
            for trajectory in (t for group in groups for t in group):
                trajectory.fill_versions(version)

    def _sampling_params(self, sampling_params) -> dict:
        params = engine_sampling_params(sampling_params)
        return self.tool_use.sampling_params(params) if self.tool_use else params

    def _on_this_rank(self, seed: int, make_coroutine):
        """Run one rollout coroutine on this rank's engine, seeded. An error on any rank is raised on
        every rank (rather than leaving the others waiting in the gather of the results), with every
        failing rank's message; an `EngineError` when only engines failed."""
        with self.state.sampling(), use_sandbox(self.sandbox):
            # The engine samples with torch's global generator; fork it so the trainer's stream is untouched.
            devices = [self.device] if self.device.type == "cuda" else []
            result, error, failure = None, None, None
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                try:
                    result = run_on_rank_loop(make_coroutine())
                except Exception as e:
                    failure = e
                    error = (isinstance(e, EngineError), f"rank {dist.get_rank()}: {type(e).__name__}: {e}")
            errors = [e for e in self._gather(error) if e]
            if errors:
                message = "\n".join(text for _, text in errors)
                if all(engine_failed for engine_failed, _ in errors):
                    raise EngineError("the rollout engine failed:\n" + message) from failure
                raise RuntimeError("the rollout failed:\n" + message) from failure
        return result

    def _gather(self, obj) -> list:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def sync_weights(self, fsdp_model: torch.nn.Module, version: str) -> None:
        """The policy (`fsdp_model`, the one given at construction) was updated: the engine gets its weights,
        named `version` (its `weight_version`), now or at the start of the next rollout (see
        `EngineState.synced`). Collective."""
        if fsdp_model is not self.policy.model:
            raise ValueError("RolloutWorker.sync_weights takes the policy it was built with")
        self.state.synced(version)

    def take_push_seconds(self) -> float:
        """Seconds spent pushing weights into the engine since the last call: a push happens at the
        sync, or for a colocated engine at the start of the next rollout (see `EngineState.synced`)."""
        seconds, self.push_seconds = self.push_seconds, 0.0
        return seconds

    @torch.no_grad()
    def _push_weights(self, version: str) -> None:
        """Copy the policy's current weights into the engine, parameter by parameter. Collective.

        Ranks on one CPU host exchange their shards through shared memory (set up at the first sync);
        otherwise each parameter is all-gathered on its own. A LoRA policy's weights are merged on the way.
        """
        model = self.policy.model
        if self._shared_gather is None:  # not on GPUs, where a LoRA policy's shards wait on the CPU during a sync
            self._shared_gather = shared_weight_gather(model, self.dtype, self.device) or False
        began = time.perf_counter()
        tensors = self._shared_gather.full_tensors() if self._shared_gather else full_tensors(model, self.dtype)
        self.engine.update_weights(self.policy.engine_weights(tensors), weight_version=version)
        self.push_seconds += time.perf_counter() - began

