"""The trainers (`python -m RL2.trainer.<name>`), the step loop they share and their YAML defaults (`config/`)."""
