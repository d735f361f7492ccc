"""Agents: agent code written against the `openai` (or `anthropic`) client, rolled out as trajectories on top of
`RL2.rollout` (which never imports this package): `endpoint` serves the APIs (`chat_api`, `responses_api`,
`messages_api`) over a rank's engine and records the tokens; `agent` runs the scripts."""
