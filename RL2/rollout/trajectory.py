"""What one rollout produced, token by token, and its conversion to training examples.

Token in, token out: the trainer trains on exactly the token ids the engine sampled, with the
log-probabilities the engine returned for them, never on a re-tokenisation of the decoded text.
Text does not round-trip through a tokenizer: `decode` then `encode` can merge or split tokens
differently (e.g. a `<think>` the model spelled in pieces comes back as one special token), and the
trainer would then compute log-probabilities, ratios and KL for tokens the policy never sampled
(verl's and upstream RL2's multi-turn rollouts keep engine token ids for this reason). Only the
environment's text is tokenised here, and it is masked out of the loss.
"""

from dataclasses import asdict, dataclass, field


@dataclass
class Turn:
    """One action of the policy and what the environment answered.

    Attributes:
        action_ids: the sampled token ids, as the engine returned them.
        action_logps: the engine's log-probability of each sampled token.
        action_text: the decoded action, as given to the environment.
        finish_reason: the engine's: "stop", "length" or "abort".
        reward, score: what the environment's `step` returned for this action.
        reward_parts: the step's named reward parts (logged as `rollout/reward/<name>`).
        env_ids: observation tokens appended after the action when the next turn continues the
            same sequence (empty when the trajectory ends here or starts a new sequence).
        env_text: the text `env_ids` were tokenised from.
    """

    action_ids: list[int]
    action_logps: list[float]
    action_text: str
    finish_reason: str
    reward: float = 0.0
    score: float = 0.0
    env_ids: list[int] = field(default_factory=list)
    env_text: str = ""
    reward_parts: dict[str, float] = field(default_factory=dict)


@dataclass
class TokenSequence:
    """A prompt followed by turns that each extend it; becomes one training example."""

    prompt_ids: list[int]
    prompt_text: str
    turns: list[Turn] = field(default_factory=list)

    @property
    def input_ids(self) -> list[int]:
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids += turn.action_ids + turn.env_ids
        return ids


@dataclass
class Trajectory:
    """Everything one prompt's rollout produced: one or more token sequences.

    Attributes:
        extra_info: the prompt row's `extra_info` (the dict the rollout started with).
        sequences: the sequences, in order; the turns of all of them form the trajectory.
        stop_reason: "done", "max_turns", "budget" (token budget), "fault" or "abort".
        fault: why the environment failed (exception, timeout, malformed result), or None.
        state: the environment's current state text, kept for resuming an aborted trajectory.
        env_info: the `extra_info` the environment returned last (what its next `step` gets).
    """

    extra_info: dict
    sequences: list[TokenSequence] = field(default_factory=list)
    stop_reason: str = ""
    fault: str | None = None
    state: str = ""
    env_info: dict | None = None

    def to_dict(self) -> dict:
        """Plain JSON-able form (a checkpoint keeps the unfinished trajectories of a partial rollout)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Trajectory":
        sequences = [
            TokenSequence(seq["prompt_ids"], seq["prompt_text"], [Turn(**turn) for turn in seq["turns"]])
            for seq in data["sequences"]
        ]
        return cls(**(data | {"sequences": sequences}))

    # ---- building ----

    def start_sequence(self, prompt_text: str, prompt_ids: list[int]) -> None:
        self.sequences.append(TokenSequence(list(prompt_ids), prompt_text))

    def add_turn(self, turn: Turn) -> None:
        self.sequences[-1].turns.append(turn)

    def continue_sequence(self, env_text: str, env_ids: list[int]) -> None:
        """Append the environment's observation to the current sequence, after the last action."""
        last = self.sequences[-1].turns[-1]
        last.env_text, last.env_ids = env_text, list(env_ids)

    def extend_last_action(self, turn: "Turn", text: str) -> None:
        """Append the rest of an aborted action (sampled after a pause) to the last turn."""
        last = self.sequences[-1].turns[-1]
        last.action_ids += turn.action_ids
        last.action_logps += turn.action_logps
        last.action_text, last.finish_reason = text, turn.finish_reason

    @property
    def unfinished(self) -> bool:
        """Stopped by an engine pause in the middle of an action (partial rollout carries it on)."""
        return self.stop_reason == "abort"

    def fail(self, fault: str) -> None:
        """End on an environment fault: every reward and score becomes 0."""
        self.fault, self.stop_reason = fault, "fault"
        for turn in self.turns:
            turn.reward = turn.score = 0.0
            turn.reward_parts = {}

    # ---- reading ----

    @property
    def turns(self) -> list[Turn]:
        return [turn for seq in self.sequences for turn in seq.turns]

    @property
    def current_ids(self) -> list[int]:
        """The token ids the next action is sampled after."""
        return self.sequences[-1].input_ids

    @property
    def n_turns(self) -> int:
        return len(self.turns)

    @property
    def reward(self) -> float:
        return sum(turn.reward for turn in self.turns)

    @property
    def score(self) -> float:
        return sum(turn.score for turn in self.turns)

    @property
    def response_length(self) -> int:
        """Sampled tokens over all turns."""
        return sum(len(turn.action_ids) for turn in self.turns)

    @property
    def finish_reason(self) -> str:
        """The engine's finish reason of the last action ("length" means it was cut)."""
        turns = self.turns
        return turns[-1].finish_reason if turns else ""

    @property
    def prompt_text(self) -> str:
        return self.sequences[0].prompt_text if self.sequences else ""

    @property
    def response_text(self) -> str:
        """Actions and the observations merged between them, for inspection."""
        return "".join(turn.action_text + turn.env_text for turn in self.turns)

    def to_examples(self) -> list[dict]:
        """One training example per sequence, in the packing format (`RL2.datasets.packing`).

        Per token (same length as `input_ids`): `loss_mask` 1 exactly on sampled tokens,
        `engine_logps` the engine's log-probabilities there (0.0 elsewhere), `turn_ids` the turn
        index of each sampled token in the whole trajectory (-1 elsewhere). Per trajectory:
        `reward`, `score`, `n_turns`, `response_length` (sampled tokens of the whole trajectory),
        `turn_rewards` (one per turn, for multi-turn returns).
        """
        per_trajectory = {
            "reward": self.reward,
            "score": self.score,
            "n_turns": self.n_turns,
            "response_length": self.response_length,
            "turn_rewards": [turn.reward for turn in self.turns],
        }
        examples, turn_index = [], 0
        for seq in self.sequences:
            example = {"input_ids": [], "loss_mask": [], "engine_logps": [], "turn_ids": []}
            _extend(example, seq.prompt_ids, 0, [0.0] * len(seq.prompt_ids), -1)
            for turn in seq.turns:
                _extend(example, turn.action_ids, 1, turn.action_logps, turn_index)
                _extend(example, turn.env_ids, 0, [0.0] * len(turn.env_ids), -1)
                turn_index += 1
            examples.append(example | per_trajectory)
        return examples


def _extend(example: dict, ids: list[int], mask: int, logps: list[float], turn_id: int) -> None:
    example["input_ids"] += ids
    example["loss_mask"] += [mask] * len(ids)
    example["engine_logps"] += list(logps)
    example["turn_ids"] += [turn_id] * len(ids)
