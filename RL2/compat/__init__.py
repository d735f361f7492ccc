"""The original RL2's config keys, command lines and env scripts' protocol (docs/compatibility.md)."""
