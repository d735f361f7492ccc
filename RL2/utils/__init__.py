"""Logging (metrics.jsonl, wandb, TensorBoard), checkpoints and learning curves."""
