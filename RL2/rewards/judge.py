"""An LLM as the judge of a response: a rubric (chat messages with {question}, {response} and {reference} in
them) is sent to a chat function (`ChatFn`: `openai_chat`, or `RL2.rollout.judge_engine`'s frozen model), and the
score in its answer, normalised to [0, 1], is the reward; no score raises `JudgeError` (docs/rewards.md)."""

import asyncio
import contextlib
import json
import os
import re
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from pathlib import Path

from RL2.loop_thread import LoopThread
from RL2.rewards.extract import last_tag

ChatFn = Callable[[list[dict]], Awaitable[str]]

_PLACEHOLDER = re.compile(r"\{(question|response|reference)\}")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _few_shot(template: str, *shots: tuple[dict, int]) -> list[dict]:
    """The user turn `template` after worked examples (its values, their score): they teach even a small judge
    the <score>N</score> format, which it seldom follows when only told to."""
    messages = []
    for values, score in shots:
        messages += [{"role": "user", "content": template.format(**values)},
                     {"role": "assistant", "content": f"<score>{score}</score>"}]
    return messages + [{"role": "user", "content": template}]


_ASK = "Grade it from 0 to 10 as <score>N</score>."
# The built-in rubrics, by name; both ask for a score from 0 to 10.
RUBRICS = {
    "correctness": _few_shot(
        "Question: {question}\nReference answer: {reference}\nAnswer: {response}\nIs the answer correct? " + _ASK,
        ({"question": "What is 2 + 2?", "reference": "4", "response": "2 + 2 = 4."}, 10),
        ({"question": "What is 3 + 6?", "reference": "9", "response": "3 + 6 = 8."}, 0)),
    "quality": _few_shot(
        "Question: {question}\nAnswer: {response}\nHow correct and helpful is the answer? " + _ASK,
        ({"question": "What is the capital of France?", "response": "Paris."}, 10),
        ({"question": "What is the capital of France?", "response": "Bananas are yellow."}, 0)),
}


class JudgeError(RuntimeError):
    """The judge gave no score: its trajectory ends as a fault (`rollout/faults/judge`)."""


def parse_score(answer: str, score_range: tuple[float, float] = (0, 10)) -> float | None:
    """The judge's score normalised to [0, 1]: the number N of the answer's last `<score>N</score>` (an integer or
    a decimal, spaces around it allowed), `(N - low) / (high - low)` for `score_range` (low, high). None when the
    answer has no such tag, the tag holds anything but one number, or N lies outside the range."""
    low, high = score_range
    content = last_tag(answer, "score")
    if content is None or not _NUMBER.fullmatch(content):
        return None
    number = float(content)
    return (number - low) / (high - low) if low <= number <= high else None


def load_rubric(rubric: str | list[dict]) -> list[dict]:
    """The rubric's chat messages: a built-in name (`RUBRICS`), a .json file of chat messages, another file whose
    text is the user message, the user message's text itself, or a list of messages. Messages are dicts with a
    role and a text content; the last is the user's, and {response} appears in them."""
    where = "the judge's rubric (rollout.judge.rubric)"
    if isinstance(rubric, str):
        if rubric in RUBRICS:
            rubric = RUBRICS[rubric]
        elif "{response}" not in rubric and Path(rubric).expanduser().is_file():
            path = Path(rubric).expanduser()
            where = f"the judge's rubric {path}"
            text = path.read_text()
            rubric = json.loads(text) if path.suffix == ".json" else [{"role": "user", "content": text}]
        else:
            rubric = [{"role": "user", "content": rubric}]
    if not (isinstance(rubric, list) and rubric and all(_is_message(m) for m in rubric)):
        raise ValueError(f"{where} should be chat messages ({{'role': ..., 'content': '...'}}), got {rubric!r:.200}")
    if rubric[-1]["role"] != "user":
        raise ValueError(f"{where} should end with the user's message, which the judge answers")
    if not any("{response}" in m["content"] for m in rubric):
        raise ValueError(f"{where} never shows the response: write {{response}} where it goes (a built-in name is "
                         f"one of {sorted(RUBRICS)}; a file path must exist)")
    return [dict(m) for m in rubric]


def _is_message(message: object) -> bool:
    return isinstance(message, dict) and all(isinstance(message.get(key), str) for key in ("role", "content"))


class Judge:
    """A reward function `(response, extra_info) -> score in [0, 1]` asking `chat` (see `ChatFn`) with `rubric`
    (the question and reference from `extra_info[question_key]`, `extra_info[reference_key]`). At most
    `max_concurrency` calls are in flight, each of `timeout` s; a failed one is asked again up to `max_retries`
    times. The calls run on a loop and thread of the judge's own, so callers on any loop share one client and
    one bound. `on_close`: called on that loop by `close` (e.g. stopping the judge's engine)."""

    def __init__(self, chat: ChatFn, rubric: str | list[dict] = "quality", score_range: tuple[float, float] = (0, 10),
                 max_concurrency: int = 8, timeout: float | None = 60.0, max_retries: int = 2,
                 question_key: str = "question", reference_key: str = "answer", on_close: Callable | None = None):
        low, high = score_range
        if not low < high or max_concurrency < 1 or max_retries < 0:
            raise ValueError(f"a judge needs score_range low < high, max_concurrency >= 1 and max_retries >= 0; got "
                             f"{score_range}, {max_concurrency}, {max_retries}")
        self.chat, self.messages, self.score_range = chat, load_rubric(rubric), (low, high)
        self.timeout, self.max_retries, self.on_close = timeout, max_retries, on_close
        self.keys = {"question": question_key, "reference": reference_key}
        self.shows = {name for m in self.messages for name in _PLACEHOLDER.findall(m["content"])} - {"response"}
        self.slots = asyncio.Semaphore(max_concurrency)  # used on the judge's loop only
        self._thread = LoopThread("rl2-judge")
        self.loop = self._thread.loop

    async def __call__(self, response: str, extra_info: dict) -> float:
        missing = [self.keys[name] for name in sorted(self.shows) if self.keys[name] not in extra_info]
        if missing:
            raise KeyError(f"the judge's rubric shows {missing} of extra_info, which has {sorted(extra_info)}; add "
                           f"them to the data rows, or name other keys (rollout.judge.question_key / reference_key)")
        return await self.score(response, **{name: str(extra_info[self.keys[name]]) for name in self.shows})

    async def score(self, response: str, question: str = "", reference: str = "") -> float:
        """The judge's score of `response` in [0, 1]; raises `JudgeError` when it gives none."""
        values = {"question": question, "response": response, "reference": reference}
        # One substitution pass: a response that writes "{question}" stays as written.
        messages = [m | {"content": _PLACEHOLDER.sub(lambda match: values[match.group(1)], m["content"])}
                    for m in self.messages]
        return await asyncio.wrap_future(self._thread.submit(self._ask(messages)))

    async def _ask(self, messages: list[dict]) -> float:
        async with self.slots:
            for _ in range(self.max_retries + 1):
                try:
                    answer = await asyncio.wait_for(self.chat(messages), self.timeout)
                except TimeoutError:
                    failure = f"no answer within {self.timeout} s"
                except Exception as e:  # the server's, the client's or the engine's error: asked again
                    failure = f"{type(e).__name__}: {e}"
                else:
                    score = parse_score(answer, self.score_range)
                    if score is not None:
                        return score
                    failure = f"no <score>N</score> with N in {list(self.score_range)} in its answer {answer!r:.300}"
        raise JudgeError(f"the judge gave no score in {self.max_retries + 1} attempts; the last: {failure}")

    def close(self) -> None:
        """Stop the judge's loop (and what `on_close` stops); calls still waiting on it never return."""
        with contextlib.suppress(RuntimeError):  # closed already
            if self.on_close is not None:
                self.loop.call_soon_threadsafe(self.on_close)
            self._thread.stop()


def openai_chat(url: str, model: str, api_key: str | None = None, max_tokens: int = 256,
                temperature: float = 0.0) -> ChatFn:
    """A `ChatFn` of `model` at an OpenAI-compatible server (`url`, e.g. http://host:8000/v1) through
    `openai.AsyncOpenAI`, whose own retries are off (the judge retries). `api_key`: default $OPENAI_API_KEY."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none", max_retries=0)

    async def chat(messages: list[dict]) -> str:
        completion = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                          temperature=temperature)
        return completion.choices[0].message.content or ""

    return chat


# The run's judge (`rollout.judge`), entered by the rollout for each rollout as the code sandbox is: environment
# code on the environments' loop reads the judge of the rollout that called it.
_run_judge: ContextVar[Judge | None] = ContextVar("run_judge", default=None)


@contextlib.contextmanager
def use_judge(judge: Judge | None) -> Iterator[None]:
    """Within, `current_judge()` is `judge`."""
    token = _run_judge.set(judge)
    try:
        yield
    finally:
        _run_judge.reset(token)


def current_judge() -> Judge:
    """The run's judge; a clear error when the run has none."""
    judge = _run_judge.get()
    if judge is None:
        raise RuntimeError("this run has no judge: set rollout.judge.url (an OpenAI-compatible server) or "
                           "rollout.judge.model_path (a frozen model RL2 serves), or call a Judge of your own")
    return judge


async def judge_reward(response: str, extra_info: dict) -> float:
    """The run's judge's score of the response, in [0, 1] (`rollout.reward_fn=RL2.rewards:judge_reward`)."""
    return await current_judge()(response, extra_info)
