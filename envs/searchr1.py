"""Search-R1 (arXiv 2503.09516): the policy searches between <search></search> and answers between
<answer></answer>, over several turns (rollout.max_turns=2 or more, and the stop strings
rollout.train_sampling_params.stop=['</search>','</answer>'], so that each action ends at its tag).
Reward and score 1 when the answer is one of `extra_info["answer"]` (a string or a list) after SQuAD's
normalisation, else 0; a search returns the passages found, an action with neither tag a reminder of both.

Searches go to a BM25 index of the JSONL corpus named by RL2_SEARCH_CORPUS (`RL2.rewards.retrieval`),
or else to a service that speaks the original RL2's protocol at RL2_SEARCH_URL (default
http://localhost:10000/search), such as `python -m RL2.rewards.retrieval corpus.jsonl`.
"""

import os
import re
import string

import aiohttp

from RL2.rewards.retrieval import search_r1_passages

TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
TOP_K = 3
INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
           "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
           "Let me try again.\n")


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


async def search(query: str) -> str:
    corpus = os.environ.get("RL2_SEARCH_CORPUS")
    if corpus:
        return search_r1_passages(corpus, query, TOP_K)
    url = os.environ.get("RL2_SEARCH_URL", "http://localhost:10000/search")
    async with aiohttp.ClientSession() as session, session.post(url, json={"query": query}) as response:
        response.raise_for_status()
        return (await response.json())["passage"].strip()


async def step(state: str, action: str, extra_info: dict) -> dict:
    match = TAG.search(action)
    if match is None:
        return {"next_state": state + action + INVALID, "reward": 0.0, "done": False}
    kind, text = match.group(1), match.group(2).strip()
    if kind == "search":
        observation = f"\n\n<information>{await search(text)}</information>\n\n"
        return {"next_state": state + action + observation, "reward": 0.0, "done": False}
    answers = extra_info["answer"]
    answers = [answers] if isinstance(answers, str) else answers
    reward = float(normalize_answer(text) in {normalize_answer(a) for a in answers})
    return {"reward": reward, "score": reward, "done": True}
