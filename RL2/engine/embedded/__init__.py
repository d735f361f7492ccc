"""The in-process engine, `EmbeddedEngine` in `engine.py` (docs/cpu.md, "The embedded engine")."""
