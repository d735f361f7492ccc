"""A web page over a PPO run's saved trajectories and metrics (a wing: nothing in RL2 imports it), served by
`python -m RL2.viewer SAVE_DIR` or written as one file with `--html FILE`; plain HTML, JS and CSS (`static/`), with
no build step and nothing fetched from elsewhere (docs/outputs.md)."""
