"""A session: one trajectory's calls to the endpoint, and how each call's prompt joins its sequences. As in the
environment loop (`RL2.rollout.loop.continuation`), a prompt that starts with a sequence's text so far continues it
(only the new text is tokenised and appended, masked), any other starts a new sequence; an assistant message the
client sends back renders as exactly what the model sampled (`Session.as_sampled`), whichever API carried it."""

import json
from dataclasses import dataclass, field

from RL2.agents.requests import text_of
from RL2.rollout.loop import end_text
from RL2.rollout.trajectory import TokenSequence, Trajectory, Turn
from RL2.utils.tokens import Spans, encode, spans_after

# What the calls of a session are counted by (`Trajectory.agent_calls`): the API of each, and those streamed.
CALL_KINDS = ("chat", "completions", "responses", "messages", "streamed")


@dataclass
class Tip:
    """Where one sequence of a session stands: its text so far (a call's prompt that starts with it
    continues the sequence) and the special token its last action ended with, if any."""

    sequence: TokenSequence
    text: str
    end_text: str
    turns: int


@dataclass
class Prompt:
    """A call's prompt as token ids, and the sequence it continues (`tip`; None: a new sequence)."""

    text: str
    ids: list[int]
    tip: Tip | None = None
    added: str = ""
    added_ids: list[int] = field(default_factory=list)


class Session:
    """One trajectory's calls; its agent's client talks to `OpenAIEndpoint.base_url_of(session)`."""

    def __init__(self, session_id: str, sampling_seed: int | None):
        self.id = session_id
        self.trajectory = Trajectory(extra_info={}, agent_calls=dict.fromkeys(CALL_KINDS, 0))  # what the calls sampled
        self.sampling_seed = sampling_seed  # call k samples with `sample_seed(sampling_seed, k)` unless it gives `seed`
        self.error: BaseException | None = None  # the engine's failure, if a call met one (the rollout raises it)
        self.closed = False
        self.calls = 0
        self.sampled_tokens = 0  # over all calls and choices, against the endpoint's max_tokens
        self.over_budget: str | None = None  # why a call was refused for the run's budget
        self.responses: dict[str, list[dict]] = {}  # /v1/responses: a response's id -> its conversation, as chat
        self._tips: list[Tip] = []
        self._sampled: dict[str, str] = {}  # message_key of a returned message -> the text sampled

    def prompt(self, text: str, tokenizer, plain: Spans = ()) -> Prompt:
        """The call's prompt: continuing the sequence whose text it extends most, else a new one. `plain`: the spans
        of `text` where content wrote special tokens' text (`RL2.utils.tokens.encode`). A sequence goes on only after
        the end-of-turn token its action sampled (not in its text), not added again (as `RL2.rollout.loop`)."""
        extended = [tip for tip in self._tips if text.startswith(tip.text + tip.end_text)]
        if not extended:
            return Prompt(text, encode(tokenizer, text, plain))
        best = max(extended, key=lambda tip: len(tip.text))
        offset = len(best.text + best.end_text)
        added = text[offset:]
        added_ids = encode(tokenizer, added, spans_after(plain, offset))
        return Prompt(text, best.sequence.input_ids + added_ids, best, added, added_ids)

    def record(self, prompt: Prompt, turns: list[Turn], tokenizer) -> None:
        """Add a call's turns, one per choice: the first continues the prompt's sequence, if it still can,
        the others (and the first when another call continued that sequence meanwhile) start their own."""
        if prompt.tip is None and self._tips:  # a conversation that extends none the session sampled: a split turn
            self.trajectory.split_turns += 1
        for i, turn in enumerate(turns):
            tip = prompt.tip if i == 0 else None
            if tip is not None and tip.turns == len(tip.sequence.turns):
                last = tip.sequence.turns[-1]
                last.env_text, last.env_ids = prompt.added, list(prompt.added_ids)
                tip.sequence.turns.append(turn)
            else:
                self.trajectory.start_sequence(prompt.text, prompt.ids)
                self.trajectory.add_turn(turn)
                tip = Tip(self.trajectory.sequences[-1], "", "", 0)
                self._tips.append(tip)
            tip.text = prompt.text + turn.action_text
            tip.end_text = end_text(tokenizer, turn.action_ids)
            tip.turns = len(tip.sequence.turns)

    def remember(self, message: dict, sampled_text: str) -> None:
        """A returned assistant message renders as `sampled_text` when the client sends it back."""
        self._sampled.setdefault(message_key(message), sampled_text)

    def as_sampled(self, messages: list[dict]) -> list[dict]:
        """The conversation with each assistant message this session returned as its sampled text."""
        out = []
        for message in messages:
            sampled = self._sampled.get(message_key(message)) if message.get("role") == "assistant" else None
            out.append(message if sampled is None else {"role": "assistant", "content": sampled})
        return out


def message_key(message: dict) -> str:
    """An assistant message as the client may send it back: content, and calls with arguments compared as JSON."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append([function.get("name"), arguments])
    return json.dumps([text_of(message.get("content")), calls], sort_keys=True, default=str)
