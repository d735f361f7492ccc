"""Agent code written against the `openai` (or `anthropic`) client, rolled out on top of `RL2.rollout` (never
imported there): `endpoint` serves the APIs (`*_api`) over a rank's engine, recording the tokens; `agent` runs it."""
