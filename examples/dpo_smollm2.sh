#!/usr/bin/env bash
# DPO on the embedded SmolLM2-135M-Instruct with generated arithmetic preference pairs (CPU).
# chosen: the correct worked answer; rejected: the same with a wrong number. Extra key=value arguments override.
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/data/make_arithmetic.py --out data/arith
python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" -m RL2.trainer.dpo \
    data.train.path=data/arith/dpo_train.jsonl \
    data.test.path=data/arith/dpo_test.jsonl \
    data.train.batch_size=16 \
    actor.model_name=smollm2-135m-instruct \
    actor.max_length_per_device=2048 \
    actor.optimizer.lr=1e-6 \
    actor.beta=0.1 \
    trainer.experiment_name=dpo_smollm2 \
    trainer.total_steps=10 \
    trainer.test_freq=5 \
    "$@"
