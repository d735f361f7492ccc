"""Agents: agent code written against the `openai` client, rolled out as trajectories on top of `RL2.rollout` (which
never imports this package): `openai_server`, an OpenAI-compatible HTTP endpoint over a rank's engine that records
the tokens, and `agent`, agent scripts (`async def run(client, extra_info)`) rolled out as trajectories."""
