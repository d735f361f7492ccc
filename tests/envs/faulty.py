"""Test env that misbehaves as extra_info["fault"] says, after extra_info["after"] good steps; its reset
misbehaves as extra_info["reset_fault"] says."""

import asyncio
import sys
import time


async def reset(extra_info: dict):
    if extra_info.get("reset_fault") == "raise":
        raise ConnectionError("no game server")
    if extra_info.get("reset_fault") == "exit":
        sys.exit(4)
    if extra_info.get("reset_fault") == "unrenderable":  # messages the chat template cannot render
        return [{"role": "user", "content": 5}]
    return [{"role": "user", "content": "Play."}]


async def step(state: str, action: str, extra_info: dict) -> dict:
    extra_info["seen"] = extra_info.get("seen", 0) + 1
    if extra_info["seen"] <= extra_info.get("after", 0):
        return {"next_state": state + action, "reward": 1.0, "done": False, "extra_info": extra_info}
    if extra_info["fault"] == "raise":
        raise KeyError("broken env")
    if extra_info["fault"] == "sleep":
        await asyncio.sleep(30)
    if extra_info["fault"] == "block":  # blocking code in an async step (a sync HTTP call, time.sleep)
        time.sleep(extra_info.get("block_s", 1.0))
    if extra_info["fault"] == "exit":
        sys.exit(3)
    if extra_info["fault"] == "huge":  # an observation far longer than any token budget
        return {"next_state": state + action + "x" * 20_000_000, "reward": 1.0, "done": False}
    if extra_info["fault"] == "malformed":
        return {"reward": "high", "done": True}
    if extra_info["fault"] == "unrenderable":  # messages the chat template cannot render (content not text)
        return {"next_state": [{"role": "user", "content": 5}], "reward": 1.0, "done": False}
    if extra_info["fault"] == "empty":  # a new sequence of no tokens: nothing to sample after
        return {"next_state": "", "reward": 1.0, "done": False}
    return {"next_state": state + action, "reward": 1.0, "done": True}
