"""What the RL loop asks of an inference engine, whichever it is: requests and responses are SGLang's `POST /generate`
JSON, and `RL2.rollout.engine_state.EngineState` makes the memory calls and the pushes from what an engine says of
itself (`releases_memory`, `follows_policy`), so the loop never asks which one it drives."""

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch


class EngineError(RuntimeError):
    """The inference engine failed or could not be reached; the rollout cannot go on."""


@runtime_checkable
class Engine(Protocol):
    # The engine frees memory when asked (`release_memory`) and takes it back (`resume_memory`): SGLang servers on the
    # trainer's GPUs, the embedded engine on CPU (the trainer's update needs the RAM). False: never asked.
    releases_memory: bool
    # The engine takes the policy's weights after each update (False: SGLang with `rollout.weight_sync=none`).
    follows_policy: bool

    async def generate(self, payload: dict) -> dict:
        """Serve one request: {"input_ids": [...], "sampling_params": {...}, "return_logprob": True} ->
        {"text", "output_ids", "meta_info": {"output_token_logprobs", "finish_reason", ...}}."""

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop this rank's generation until `continue_generation`; its new requests wait meanwhile. `mode` "abort":
        this rank's requests in flight return at once with finish_reason abort and their partial output. "retract" and
        "in_place": the embedded engine re-prefills its requests after `continue_generation`, or holds them; SGLang
        servers serve every rank and are not paused, so this rank's requests run to their end."""

    async def continue_generation(self) -> None:
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> None:
        """Load new weights, full tensors under the names of the trainer's model (`RL2.engine.checkpoint_layout` maps
        them for an engine that loads checkpoints), after `resume_memory` if they were released. Call it between
        rollouts: requests still running would go on with the new weights. Collective: every rank calls it (the tensors
        are gathered from the trainer's shards as they are iterated). Responses report `weight_version`."""

    def release_memory(self, tags: Iterable[str]) -> None:
        """Free memory for the trainer between rollouts, by SGLang's tags: "weights" (lost until `update_weights` writes
        them all again), "kv_cache", "cuda_graph" (the embedded engine has none). Asked only if `releases_memory`."""

    def resume_memory(self, tags: Iterable[str]) -> None:
        """Take back memory released under `tags`, before pushing weights or sampling (SGLang servers fail on a tag
        that is not released)."""

    def shutdown(self) -> None:
        ...
