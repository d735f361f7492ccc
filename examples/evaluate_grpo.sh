#!/usr/bin/env bash
# Evaluate the model of examples/grpo_smollm2.sh against the default model it started from, on the
# held-out sums and differences: 4 samples per prompt at temperature 1 (as the run's own tests), pass@1
# and pass@4, a sample passing when its answer is right (envs/arithmetic.py's score 1). Prints both
# models side by side with the difference; evals/grpo_smollm2 gets samples.jsonl and metrics.json.
# MODEL=... evaluates another folder; extra key=value arguments override the config.
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/data/make_arithmetic.py --out data/arith
python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" -m RL2.evaluate \
    model.model_name="${MODEL:-ckpts/grpo_smollm2/final/actor}" \
    compare.model_name=smollm2-135m-instruct \
    data.test.path=data/arith/rl_test.jsonl \
    rollout.env_path=envs/arithmetic.py \
    rollout.responses_per_prompt=4 \
    rollout.sampling_params.temperature=1.0 \
    rollout.sampling_params.max_new_tokens=32 \
    eval.k=[1,4] \
    eval.save_dir=evals/grpo_smollm2 \
    "$@"
