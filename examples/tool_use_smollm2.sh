#!/usr/bin/env bash
# A tool-using agent that learns on CPU, in one script with two trainers: the embedded SmolLM2-135M-Instruct
# calls a calculator (products of 3-digit numbers, which it cannot work out in its head) and a BM25 search
# over a made-up encyclopedia (capitals it cannot know), in its chat template's tool format (RL2's default
# Hermes-style <tool_call> JSON, as its template shows no tools); see envs/tool_use.py.
#  1. the default model on the held-out questions: it almost never writes a valid call;
#  2. a short SFT on generated one-call conversations (RL2.trainer.sft);
#  3. GRPO from that checkpoint (RL2.trainer.ppo), the calls run by RL2 between the model's turns.
# Held-out accuracy and tool calls per question are in evals/tool_use_base/metrics.json (1) and in
# ckpts/tool_use_grpo/metrics.jsonl and learning_curve.png at every test of (3) (test/score,
# test/tool_calls; step 0 is the SFT model). Extra key=value arguments go to the GRPO run.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${NPROC:-2}"
run() { python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "$@"; }
python examples/data/make_tool_use.py --out data/tool_use
TOOL_ROLLOUT=(rollout.env_path=envs/tool_use.py rollout.max_turns=3)

run -m RL2.evaluate \
    model.model_name=smollm2-135m-instruct \
    data.test.path=data/tool_use/rl_test.jsonl \
    "${TOOL_ROLLOUT[@]}" \
    rollout.responses_per_prompt=2 \
    rollout.sampling_params.temperature=1.0 \
    rollout.sampling_params.max_new_tokens=48 \
    eval.k=[1] \
    eval.save_dir=evals/tool_use_base

run -m RL2.trainer.sft \
    data.train.path=data/tool_use/sft_train.jsonl \
    data.train.batch_size=16 \
    actor.model_name=smollm2-135m-instruct \
    actor.dtype=auto \
    actor.max_length_per_device=4096 \
    actor.optimizer.lr=1e-4 \
    actor.scheduler.name=cosine \
    actor.scheduler.warmup_ratio=0.1 \
    trainer.experiment_name=tool_use_sft \
    trainer.total_steps="${SFT_STEPS:-8}"

run -m RL2.trainer.ppo \
    data.train.path=data/tool_use/rl_train.jsonl \
    data.test.path=data/tool_use/rl_test.jsonl \
    data.train.batch_size=8 \
    "${TOOL_ROLLOUT[@]}" \
    rollout.responses_per_prompt=8 \
    rollout.train_sampling_params.temperature=1.0 \
    rollout.train_sampling_params.max_new_tokens=48 \
    rollout.test_sampling_params.temperature=1.0 \
    rollout.test_sampling_params.max_new_tokens=48 \
    rollout.test_responses_per_prompt=2 \
    actor.model_name=ckpts/tool_use_sft/final/actor \
    actor.dtype=auto \
    actor.max_length_per_device=4096 \
    actor.optimizer.lr=5e-6 \
    actor.max_grad_norm=1.0 \
    adv.estimator=grpo \
    adv.norm_var=true \
    trainer.experiment_name=tool_use_grpo \
    trainer.total_steps=16 \
    trainer.test_freq=4 \
    rollout.save_samples=true \
    "$@"
