"""Engines of the tests: the real embedded engine, made to answer as a shared server sometimes does."""

from RL2.engine.embedded.engine import EmbeddedEngine


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
