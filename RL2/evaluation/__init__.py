"""Evaluation of a model (or two, side by side) on test prompts: `python -m RL2.evaluate`, `RL2.evaluate(...)`."""
