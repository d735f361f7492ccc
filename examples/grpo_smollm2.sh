#!/usr/bin/env bash
# GRPO of the embedded SmolLM2-135M-Instruct on generated small sums and differences, on CPU.
# The reward (envs/arithmetic.py) asks for the answer in <answer></answer> tags: 1 when right, 0.1
# for a wrong number in tags, 0 without them (see examples/data/make_arithmetic.py). Each rank rolls out its share of the prompts on its own
# embedded engine. Held-out accuracy (4 samples per test prompt at temperature 1, the policy RL trains) is tested every 4 steps; the run folder
# (ckpts/grpo_smollm2) gets metrics.jsonl and learning_curve.png. Extra key=value arguments override
# the config, e.g. `bash examples/grpo_smollm2.sh trainer.total_steps=3`; add `adv.estimator=gae adv.norm_var=false`
# for PPO with a critic. GRPO divides advantages by the group std (adv.norm_var=true); RL2's default is
# Dr. GRPO, which does not.
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/data/make_arithmetic.py --out data/arith
python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" -m RL2.trainer.ppo \
    data.train.path=data/arith/rl_train.jsonl \
    data.test.path=data/arith/rl_test.jsonl \
    data.train.batch_size=4 \
    rollout.env_path=envs/arithmetic.py \
    rollout.responses_per_prompt=8 \
    rollout.train_sampling_params.temperature=1.0 \
    rollout.train_sampling_params.max_new_tokens=32 \
    rollout.test_sampling_params.max_new_tokens=32 \
    rollout.test_sampling_params.temperature=1.0 \
    rollout.test_responses_per_prompt=4 \
    actor.model_name=smollm2-135m-instruct \
    actor.dtype=auto \
    actor.max_length_per_device=2048 \
    actor.optimizer.lr=1e-5 \
    actor.max_grad_norm=1.0 \
    adv.estimator=grpo \
    adv.norm_var=true \
    trainer.experiment_name=grpo_smollm2 \
    trainer.total_steps=24 \
    trainer.test_freq=4 \
    rollout.save_samples=true \
    "$@"
