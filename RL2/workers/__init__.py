"""Models trained with FSDP2 (`fsdp.py`), the RL actor and critic built on them, and the micro-batch
loop every trainer shares."""
