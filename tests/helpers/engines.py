"""Engines of the tests: the real embedded engine, made to answer as a shared server sometimes does."""

import torch
from transformers import AutoModelForCausalLM

from RL2.engine.embedded.engine import EmbeddedEngine
from RL2.rollout.tools.tool_calls import ParsedAction, ToolCallParser


def running_engine(model_path: str, tok, max_running_requests: int):
    """The real embedded engine on the float32 model at `model_path`, for a fixture to `yield from`: shut
    down when the fixture ends."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    engine = EmbeddedEngine(model, tok, max_running_requests=max_running_requests)
    yield engine
    engine.shutdown()


class CutOnce(EmbeddedEngine):
    """The real engine, whose first request comes back aborted after two tokens, as when another client
    of a shared server pauses it; `always` aborts every request before its first token."""

    def __init__(self, *args, always: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.always, self.calls = always, 0

    async def generate(self, payload: dict) -> dict:
        self.calls += 1
        if self.always:
            return {"output_ids": [], "meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}}}
        if self.calls > 1:
            return await super().generate(payload)
        cut = {**payload, "sampling_params": {**payload["sampling_params"], "max_new_tokens": 2}}
        response = await super().generate(cut)
        response["meta_info"]["finish_reason"] = {"type": "abort", "message": "paused by another client"}
        return response


class ScriptedParser(ToolCallParser):
    """Reads the k-th action as the k-th scripted `ParsedAction` (then as an answer: no calls)."""

    name = "scripted"

    def __init__(self, script: list[ParsedAction]):
        self.script = list(script)

    def parse(self, text: str) -> ParsedAction:
        return self.script.pop(0) if self.script else ParsedAction(content=text)
