"""RL2: Ray Less Reinforcement Learning, post-training for language models under torchrun."""

__version__ = "0.1.0"
