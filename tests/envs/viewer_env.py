"""Test env of the viewer's run: two turns in one sequence, an observation that holds markup (which the viewer
must show as text), and a reward with parts that differs between responses (so a GRPO group has advantages)."""


async def step(state: str, action: str, extra_info: dict) -> dict:
    extra_info["seen"] = extra_info.get("seen", 0) + 1
    parts = {"newline": float(action.startswith("\n")), "short": 1.0 / (1 + len(action))}
    done = extra_info["seen"] >= 2
    observation = "" if done else "\nresult: <script>window.__rl2_injected = 1</script> <b>bold?</b>\n"
    return {"next_state": state + action + observation, "reward": parts["newline"] + parts["short"], "done": done,
            "reward_parts": parts, "extra_info": extra_info}
