"""Inference engines for rollouts behind one protocol (`protocol.Engine`): `embedded/` in process, `sglang/` on SGLang
servers. `start_engine` picks one of `ENGINES` and builds it; everything after that goes through the protocol."""

from collections.abc import Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from RL2.engine.protocol import Engine
from RL2.utils.logging import log_rank0


def start_engine(rollout_cfg, model_path: str, dtype: torch.dtype, device: torch.device, tokenizer,
                 colocated: Sequence = (), seed: int = 0) -> Engine:
    """This rank's engine, as `rollout.engine` says (collective for SGLang), serving the initial weights `model_path`;
    the trainer's models on this rank's GPU (`colocated`) wait on the CPU while SGLang servers size their memory."""
    from RL2.engine.sglang.engine import resolve_engine

    start = ENGINES[resolve_engine(rollout_cfg, device)]
    return start(rollout_cfg, model_path, dtype, device, tokenizer, colocated, seed)


def _embedded(rollout_cfg, model_path, dtype, device, tokenizer, colocated, seed) -> Engine:
    if rollout_cfg.get("server_args"):  # e.g. the original RL2's tp_size or mem_fraction_static
        log_rank0(f"rollout.server_args {dict(rollout_cfg.server_args)} are flags of SGLang servers; the embedded "
                  f"engine runs without them (rollout.engine=sglang launches servers with them)")
    return embedded_engine(model_path, dtype, device, tokenizer, rollout_cfg.max_running_requests)


def embedded_engine(model_path: str, dtype: torch.dtype, device: torch.device, tokenizer,
                    max_running_requests: int) -> Engine:
    """An embedded engine on its own copy of the model at `model_path` (loaded here, shared with nothing)."""
    from RL2.engine.embedded.engine import EmbeddedEngine

    # Plain sdpa attention: the engine runs its own batched prefill/decode with a KV cache.
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
    return EmbeddedEngine(model.to(device).eval(), tokenizer, max_running_requests=max_running_requests,
                          owns_model=True)


def _sglang(rollout_cfg, model_path, dtype, device, tokenizer, colocated, seed) -> Engine:
    from RL2.engine.sglang.engine import SGLangEngine

    if rollout_cfg.server_url:
        return SGLangEngine.connect(rollout_cfg, model_path)
    for worker in colocated:  # back with `EngineState.to_trainer` if the servers release their memory
        worker.offload()
    engine = SGLangEngine.launch(rollout_cfg, model_path, dtype, device, seed=seed)
    if not engine.releases_memory:
        for worker in colocated:
            worker.onload()
    return engine


# rollout.engine (the choices besides auto, which `resolve_engine` makes one of these) -> how a rank starts it.
ENGINES = {"embedded": _embedded, "sglang": _sglang}


def context_length(model_path: str, server_args) -> int | None:
    """The most tokens a served sequence may hold (None when neither the flags nor the model's config say)."""
    if server_args and server_args.get("context_length"):
        return int(server_args["context_length"])
    return getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
