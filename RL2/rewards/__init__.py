"""Rewards `(response, extra_info)` for environment scripts and for `rollout.reward_fn` (`RL2.rewards:math_reward`):
math answers, formats, code run in a sandbox (`RL2.sandbox`), an LLM judge, and weighted sums of them."""

from RL2.rewards.code_reward import code_reward, parse_tests
from RL2.rewards.composite import composite, reward_step
from RL2.rewards.extract import extract_code, last_boxed, last_match, last_tag
from RL2.rewards.format_reward import regex_reward, tags_reward
from RL2.rewards.judge import Judge, JudgeError, current_judge, judge_reward, openai_chat, parse_score
from RL2.rewards.math_reward import BOXED, answers_equal, math_reward, normalise_answer, require_math_verify

__all__ = [
    "BOXED", "Judge", "JudgeError", "answers_equal", "code_reward", "composite", "current_judge", "extract_code",
    "judge_reward", "last_boxed", "last_match", "last_tag", "math_reward", "normalise_answer", "openai_chat",
    "parse_score", "parse_tests", "regex_reward", "require_math_verify", "reward_step", "tags_reward",
]
