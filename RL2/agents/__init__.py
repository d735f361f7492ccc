"""Agents: agent code written against the `openai` (or `anthropic`) client, rolled out as trajectories on top of
`RL2.rollout` (which never imports this package): `endpoint`, an HTTP endpoint over a rank's engine that serves
OpenAI's and Anthropic's APIs (`chat_api`, `responses_api`, `messages_api`) and records the tokens, and `agent`,
agent scripts (`async def run(client, extra_info)`) rolled out as trajectories."""
