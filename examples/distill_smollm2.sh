#!/usr/bin/env bash
# Distillation: the embedded SmolLM2-135M-Instruct (student) matches the token distributions of a
# teacher on the arithmetic chats. The default teacher is the model examples/sft_smollm2.sh trains;
# set TEACHER=path to use another (same tokenizer). Extra key=value arguments override.
set -euo pipefail
cd "$(dirname "$0")/.."
TEACHER="${TEACHER:-ckpts/sft_smollm2/final/actor}"
[ -d "$TEACHER" ] || { echo "teacher $TEACHER not found: run examples/sft_smollm2.sh first or set TEACHER=path" >&2; exit 1; }
python examples/data/make_arithmetic.py --out data/arith
python -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" -m RL2.trainer.distill \
    data.train.path=data/arith/sft_train.jsonl \
    data.test.path=data/arith/sft_test.jsonl \
    data.train.batch_size=16 \
    actor.model_name=smollm2-135m-instruct \
    actor.teacher_name="$TEACHER" \
    actor.kl=forward \
    actor.temperature=1.0 \
    actor.max_length_per_device=2048 \
    actor.optimizer.lr=5e-5 \
    trainer.experiment_name=distill_smollm2 \
    trainer.total_steps=10 \
    trainer.test_freq=5 \
    "$@"
