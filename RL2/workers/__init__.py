"""Models trained with FSDP2 (`fsdp.py`) with the micro-batch loop every trainer shares, and PPO's models."""
