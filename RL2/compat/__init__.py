"""RL2's original releases, translated: their config keys (`keys.py`, applied by `aliases.py`), what their
command lines mean beyond the keys' names (`command_lines.py`) and the protocol of their env scripts
(`env_protocol.py`). See docs/compatibility.md.

The core reaches it in two places: `RL2.config.cli` (`aliases.translate_original`, and
`aliases.describe_aliases` for --help) and `RL2.rollout.env` (`env_protocol.adapt_script`, once per `Env`).
"""
