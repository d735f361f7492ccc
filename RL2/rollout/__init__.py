"""The RL loop: environments, trajectories, the multi-turn rollout, its metrics, and the worker that
runs rollouts on each rank's engine and keeps the engine's weights current."""
