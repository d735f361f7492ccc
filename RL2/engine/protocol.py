"""What the RL loop asks of an inference engine, whichever it is.

Requests and responses are SGLang's `POST /generate` JSON, so one rollout loop serves both engines:
`EmbeddedEngine` (in-process, `RL2.engine.embedded`) answers them directly, `SGLangEngine`
(`RL2.engine.sglang`) sends them to SGLang servers. The memory calls matter only for SGLang servers
that share the trainer's GPUs; the embedded engine answers them as no-ops, so the loop never asks
which engine it drives.
"""

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch


class EngineError(RuntimeError):
    """The inference engine failed or could not be reached; the rollout cannot go on."""


@runtime_checkable
class Engine(Protocol):
    """Attributes:
        releases_memory: the engine gives its memory to the trainer between rollouts (SGLang servers
            on the trainer's GPUs, the embedded engine on CPU); its weights are then lost and must be
            pushed again.
        follows_policy: the engine takes the policy's weights after each update (False for SGLang
            with `rollout.weight_sync=none`: it keeps the weights it started with).
    """

    releases_memory: bool
    follows_policy: bool

    async def generate(self, payload: dict) -> dict:
        """Serve one request.

        Args:
            payload: {"input_ids": [...], "sampling_params": {...}, "return_logprob": True}.

        Returns:
            {"text", "output_ids", "meta_info": {"output_token_logprobs", "finish_reason", ...}}.
        """
        ...

    async def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating until `continue_generation`; with "abort", requests in flight return at once
        with finish_reason abort and their partial output."""
        ...

    async def continue_generation(self) -> None:
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> None:
        """Load new weights, full tensors under the names of the trainer's model (transformers' memory
        layout; an engine that loads checkpoints maps them to the checkpoint's, see
        `RL2.engine.checkpoint_layout`). Collective: every rank calls it (the tensors are gathered from
        the trainer's shards as they are iterated)."""
        ...

    def release_memory(self, tags: Iterable[str]) -> None:
        """Give memory to the trainer, by SGLang's tags: "weights", "kv_cache", "cuda_graph"."""
        ...

    def resume_memory(self, tags: Iterable[str]) -> None:
        """Take back memory released under `tags`."""
        ...

    def shutdown(self) -> None:
        ...
