#!/usr/bin/env bash
# SFT of the embedded SmolLM2-135M-Instruct on generated arithmetic chats, on CPU in a few minutes.
# Extra key=value arguments override the config, e.g. `bash examples/sft_smollm2.sh trainer.total_steps=5`.
set -euo pipefail
cd "$(dirname "$0")/.."
python examples/data/make_arithmetic.py --out data/arith
python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" -m RL2.trainer.sft \
    data.train.path=data/arith/sft_train.jsonl \
    data.test.path=data/arith/sft_test.jsonl \
    data.train.batch_size=16 \
    data.test.batch_size=64 \
    actor.model_name=smollm2-135m-instruct \
    actor.dtype=auto \
    actor.max_length_per_device=2048 \
    actor.optimizer.lr=1e-4 \
    actor.scheduler.name=cosine \
    actor.scheduler.warmup_ratio=0.1 \
    trainer.experiment_name=sft_smollm2 \
    trainer.total_steps=15 \
    trainer.test_freq=5 \
    "$@"
