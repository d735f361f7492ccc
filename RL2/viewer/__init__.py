"""A web page over a PPO run's saved trajectories and metrics (a wing: nothing in RL2 imports it).

`python -m RL2.viewer SAVE_DIR` serves `SAVE_DIR/samples.jsonl` (`rollout.save_samples=true`, with per-token
columns under `rollout.save_sample_tokens`) and `metrics.jsonl` on 127.0.0.1, following a running job;
`--html FILE` writes the same page as one self-contained file instead. The page is plain HTML, JS and CSS
(`static/`), with no build step and nothing fetched from elsewhere; see docs/outputs.md.
"""
