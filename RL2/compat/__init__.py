"""RL2's original releases, translated: their config keys (`keys.py`, applied by `aliases.py`) and what their
command lines mean beyond the keys' names (`command_lines.py`). See docs/compatibility.md.

The core reaches it through `RL2.config.cli`: `aliases.translate_original` (and `aliases.describe_aliases` for
--help).
"""
