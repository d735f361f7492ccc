"""RL2's tests: `unit/` (one process), `e2e/` (trainers and torchrun runs in fresh processes),
`gpu/` (CUDA only, skipped without a GPU); `helpers/` builds tiny models and launches runs."""
