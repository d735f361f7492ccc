"""The RL loop: environments, trajectories, the multi-turn rollout, its metrics, and each rank's rollout worker."""
