"""The trainers (`python -m RL2.trainer.<name>`): SFT, DPO, ORPO, reward models, distillation and
PPO with its relatives; the step loop they share; their YAML defaults in `config/`."""
