"""The run's judge (`rollout.judge`, for `RL2.rewards.judge_reward`): an OpenAI-compatible server, or a frozen model
that this rank serves on an embedded engine of the judge's own (not the policy's weights, which it never sees)."""

import itertools

import torch
from transformers import AutoTokenizer

from RL2.engine import embedded_engine
from RL2.engine.protocol import Engine
from RL2.models.default_model import resolve_model_path
from RL2.rewards.judge import ChatFn, Judge, openai_chat


def run_judge(judge_cfg, dtype: torch.dtype, device: torch.device) -> Judge | None:
    """The judge of `judge_cfg` (`rollout.judge`), a model served on `device` in `dtype`; None when it has none."""
    if judge_cfg.model_path:
        path = resolve_model_path(judge_cfg.model_path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        engine = embedded_engine(path, dtype, device, tokenizer, judge_cfg.max_concurrency)
        chat = engine_chat(engine, tokenizer, judge_cfg.max_new_tokens, judge_cfg.temperature)
        on_close = engine.shutdown
    elif judge_cfg.url:
        chat, on_close = openai_chat(judge_cfg.url, judge_cfg.model, judge_cfg.api_key, judge_cfg.max_new_tokens,
                                     judge_cfg.temperature), None
    else:
        return None
    return Judge(chat, judge_cfg.rubric, tuple(judge_cfg.score_range), judge_cfg.max_concurrency, judge_cfg.timeout,
                 judge_cfg.max_retries, judge_cfg.question_key, judge_cfg.reference_key, on_close)


def engine_chat(engine: Engine, tokenizer, max_new_tokens: int, temperature: float) -> ChatFn:
    """A `ChatFn` of `engine`: the messages rendered by `tokenizer`'s chat template, the answer sampled with a seed
    of its own, so that the judge never draws from torch's global generator, which seeds the policy's."""
    seeds = itertools.count()

    async def chat(messages: list[dict]) -> str:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "sampling_seed": next(seeds)}
        response = await engine.generate({"input_ids": tokenizer.encode(text, add_special_tokens=False),
                                          "sampling_params": params})
        return response["text"]

    return chat
