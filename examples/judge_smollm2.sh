#!/usr/bin/env bash
# GRPO of the embedded SmolLM2-135M-Instruct on generated small sums and differences, rewarded by an LLM judge
# (RL2.rewards:judge_reward; docs/rewards.md): a frozen copy of the same bundled model, loaded once per rank on an
# embedded engine of its own, grades each answer against the reference with the built-in `correctness` rubric, on
# CPU. A 135M judge grades poorly: this shows the machinery (the judge's scores as the reward, its failures counted
# in rollout/faults/judge), not a recipe; point rollout.judge.model_path at a stronger model, or rollout.judge.url
# at an OpenAI-compatible server, for real use. Extra key=value arguments override the config, e.g.
# `bash examples/judge_smollm2.sh trainer.total_steps=2`.
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/data/make_arithmetic.py --out data/arith
python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" -m RL2.trainer.ppo \
    data.train.path=data/arith/rl_train.jsonl \
    data.train.batch_size=4 \
    rollout.reward_fn=RL2.rewards:judge_reward \
    rollout.judge.model_path=smollm2-135m-instruct \
    rollout.judge.rubric=correctness \
    rollout.judge.max_new_tokens=10 \
    rollout.responses_per_prompt=4 \
    rollout.train_sampling_params.max_new_tokens=32 \
    actor.model_name=smollm2-135m-instruct \
    actor.dtype=auto \
    actor.max_length_per_device=2048 \
    actor.optimizer.lr=1e-5 \
    adv.estimator=grpo \
    trainer.experiment_name=judge_smollm2 \
    trainer.total_steps=8 \
    rollout.save_samples=true \
    "$@"
