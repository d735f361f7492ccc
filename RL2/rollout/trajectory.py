"""What one rollout produced, token by token, and its conversion to the training batch.

Token in, token out: the trainer trains on exactly the token ids the engine sampled, with the engine's
log-probabilities, never on a re-tokenisation of the decoded text, which can merge or split tokens differently (a
`<think>` spelled in pieces comes back as one special token; verl's and upstream RL2's multi-turn rollouts keep
engine token ids for this reason). Only the environment's text is tokenised here, masked out of the loss.
"""

import json
import re
from dataclasses import dataclass, field, is_dataclass

import torch

from RL2.batch import RolloutBatch


@dataclass
class Turn:
    """One action of the policy and what the environment answered."""

    action_ids: list[int]  # as the engine returned them
    action_logps: list[float]  # the engine's log-probability of each sampled token
    action_text: str  # the decoded action, as given to the environment
    finish_reason: str  # the engine's: "stop", "length" or "abort"
    reward: float = 0.0  # reward and score: what the environment's `step` returned for this action
    score: float = 0.0
    env_ids: list[int] = field(default_factory=list)  # the observation, where the next turn extends this sequence
    env_text: str = ""  # the text `env_ids` were tokenised from
    reward_parts: dict[str, float] = field(default_factory=dict)  # the step's, logged as `rollout/reward/<name>`
    # Each token's `weight_version_number`; short of `action_ids` where the engine named none (`fill_versions`).
    action_versions: list[int] = field(default_factory=list)

    def extend(self, rest: "Turn") -> None:
        """Append the rest of this action, sampled after a pause cut it; the caller decodes the whole text again."""
        self.action_ids += rest.action_ids
        self.action_logps += rest.action_logps
        self.action_versions += rest.action_versions
        self.finish_reason = rest.finish_reason


def weight_version_number(weight_version: str | None) -> int | None:
    """The version of weights an engine names `weight_version`: "step3" -> 3 (RL2 names each push so), "default" (the
    weights both engines start with, the policy's initial ones) -> 0, anything else (not RL2's name) -> None."""
    if weight_version == "default":
        return 0
    match = re.fullmatch(r"step(\d+)", weight_version) if isinstance(weight_version, str) else None
    return int(match.group(1)) if match else None


@dataclass
class TokenSequence:
    """A prompt followed by turns that each extend it; becomes one training sequence."""

    prompt_ids: list[int]
    prompt_text: str
    turns: list[Turn] = field(default_factory=list)

    @property
    def input_ids(self) -> list[int]:
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids += turn.action_ids + turn.env_ids
        return ids


def _jsonable(value):
    """What JSON writes for a value it cannot hold itself (`Trajectory.to_dict`)."""
    if is_dataclass(value):
        return vars(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars (a Parquet row's numbers), tensors
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return None


@dataclass
class Trajectory:
    """Everything one prompt's rollout produced: one or more token sequences, whose turns form the trajectory."""

    extra_info: dict  # the prompt row's (the dict the rollout started with)
    sequences: list[TokenSequence] = field(default_factory=list)
    row: int | None = None  # the prompt's row number in its data file (`tokenize_rows`)
    stop_reason: str = ""  # "done", "max_turns", "budget" (token budget), "fault" or "abort"
    fault: str | None = None  # why the environment failed (exception, timeout, malformed result)
    state: str = ""  # the environment's current state text, kept for resuming an aborted trajectory
    env_info: dict | None = None  # the `extra_info` the environment returned last (what its next `step` gets)
    messages: list[dict] | None = None  # the conversation so far, when the state is one (tools append to it)
    tool_calls: int = 0  # made by the policy
    tool_errors: int = 0  # calls that failed (unknown tool, bad arguments, raised, timed out)
    parse_errors: int = 0  # call blocks it wrote that could not be parsed
    tool_seconds: float = 0.0  # running tools (an agent script's own code, for agents)
    generate_seconds: float = 0.0  # waiting for the engine
    metrics: dict[str, float] = field(default_factory=dict)  # an agent's own (its result's `metrics`)
    agent_calls: dict[str, int] = field(default_factory=dict)  # an agent's model calls by API, and those streamed
    split_turns: int = 0  # turns that started a new sequence (docs/agents.md, "Token in, token out")

    def to_dict(self) -> dict:
        """Plain JSON-able form (a checkpoint keeps a partial rollout's unfinished trajectories; see `_jsonable`): a
        live object such as the game of envs/gem.py becomes None, which an environment that keeps one rebuilds."""
        # Not `asdict`, which would deep-copy such objects first (some cannot be copied).
        return json.loads(json.dumps(self, default=_jsonable))

    @classmethod
    def from_dict(cls, data: dict, version: int | None = None) -> "Trajectory":
        """The trajectory `to_dict` wrote; `version`, if given, to its sampled tokens without one (`fill_versions`)."""
        sequences = [TokenSequence(seq["prompt_ids"], seq["prompt_text"], [Turn(**turn) for turn in seq["turns"]])
                     for seq in data["sequences"]]
        trajectory = cls(**(data | {"sequences": sequences}))
        if version is not None:
            trajectory.fill_versions(version)
        return trajectory

    def start_sequence(self, prompt_text: str, prompt_ids: list[int]) -> None:
        self.sequences.append(TokenSequence(list(prompt_ids), prompt_text))

    def add_turn(self, turn: Turn) -> None:
        self.sequences[-1].turns.append(turn)

    def continue_sequence(self, env_text: str, env_ids: list[int]) -> None:
        """Append the environment's observation to the current sequence, after the last action."""
        last = self.sequences[-1].turns[-1]
        last.env_text, last.env_ids = env_text, list(env_ids)

    def fill_versions(self, version: int) -> None:
        """Give `version` to every sampled token an engine sampled without naming its weights (a turn's last ones)."""
        for turn in self.turns:
            turn.action_versions += [version] * (len(turn.action_ids) - len(turn.action_versions))

    @property
    def unfinished(self) -> bool:
        """Stopped by an engine pause in the middle of an action (partial rollout carries it on)."""
        return self.stop_reason == "abort"

    def fail(self, fault: str) -> "Trajectory":
        """End on an environment fault: every reward and score 0, trained only with rollout.train_on_faults."""
        # The reason may quote the script's text (an exception's message) with lone surrogates ("\ud800"), which
        # no UTF-8 log or file takes: they are kept as their escapes.
        self.fault = fault.encode("utf-8", "backslashreplace").decode("utf-8")
        self.stop_reason = "fault"
        for turn in self.turns:
            turn.reward = turn.score = 0.0
            turn.reward_parts = {}
        return self

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
    def versions(self) -> list[int]:
        """The weights' version of every sampled token that has one, in order."""
        return [v for turn in self.turns for v in turn.action_versions]

    @property
    def prompt_text(self) -> str:
        return self.sequences[0].prompt_text if self.sequences else ""

    @property
    def response_text(self) -> str:
        """Actions and the observations merged between them, for inspection."""
        return "".join(turn.action_text + turn.env_text for turn in self.turns)

    def token_sequences(self) -> list[dict]:
        """Each sequence's tokens as the rollout produced them, one dict per sequence, per token: `input_ids`,
        `loss_mask` (1 exactly on sampled tokens), and on sampled tokens `engine_logps` (else 0.0), `turn_ids` (the
        turn of the whole trajectory; else -1) and `versions` (of the weights that sampled it; else, or unknown, -1)."""
        sequences, turn_index = [], 0
        for seq in self.sequences:
            record = {"input_ids": [], "loss_mask": [], "engine_logps": [], "turn_ids": [], "versions": []}
            _extend(record, seq.prompt_ids, 0, [0.0] * len(seq.prompt_ids), -1, [])
            for turn in seq.turns:
                _extend(record, turn.action_ids, 1, turn.action_logps, turn_index, turn.action_versions)
                _extend(record, turn.env_ids, 0, [0.0] * len(turn.env_ids), -1, [])
                turn_index += 1
            sequences.append(record)
        return sequences


def _extend(record: dict, ids: list[int], mask: int, logps: list[float], turn_id: int, versions: list[int]) -> None:
    record["input_ids"] += ids
    record["loss_mask"] += [mask] * len(ids)
    record["engine_logps"] += list(logps)
    record["turn_ids"] += [turn_id] * len(ids)
    record["versions"] += list(versions[: len(ids)]) + [-1] * (len(ids) - len(versions))


def training_batch(groups: list[list[Trajectory]], version: int | None = None,
                   train_on_faults: bool = False) -> RolloutBatch:
    """The training batch of a rollout: every trajectory one sample, whatever its number of sequences.

    Per-token values become label-aligned (token t of a sequence is label t - 1); a sequence too short to have a
    label is left out, while its trajectory still counts. A trajectory a fault ended is left out of training whole
    (`RolloutBatch.trained`), unless `train_on_faults`. Given the `version` of the weights trained, per-token `lags`:
    how many versions behind it each token was sampled (0 where unknown, and on tokens not sampled)."""
    input_ids, sample_ids = [], []
    per_token = {"loss_mask": [], "engine_logps": [], "turn_ids": [], "versions": []}
    trajectories = [t for group in groups for t in group]
    n_turns = max((t.n_turns for t in trajectories), default=0)
    turn_rewards = torch.zeros(len(trajectories), n_turns)
    turn_mask = torch.zeros(len(trajectories), n_turns)
    trained = [train_on_faults or t.fault is None for t in trajectories]
    for sample, trajectory in enumerate(trajectories):
        turn_rewards[sample, : trajectory.n_turns] = torch.tensor([turn.reward for turn in trajectory.turns])
        turn_mask[sample, : trajectory.n_turns] = 1.0
        for record in trajectory.token_sequences() if trained[sample] else []:
            if len(record["input_ids"]) < 2:
                continue
            input_ids.append(record["input_ids"])
            sample_ids.append(sample)
            for name, values in per_token.items():
                values += record[name][1:]
    dtypes = {"loss_mask": torch.float32, "engine_logps": torch.float32, "turn_ids": torch.long}
    tokens = {name: torch.tensor(per_token[name], dtype=dtype) for name, dtype in dtypes.items()}
    if version is not None:
        versions = torch.tensor(per_token["versions"], dtype=torch.long)
        tokens["lags"] = torch.where(versions >= 0, version - versions, 0)
    return RolloutBatch(
        input_ids=input_ids, tokens=tokens, sample_ids=torch.tensor(sample_ids, dtype=torch.long),
        n_samples=len(trajectories),
        group_ids=torch.tensor([g for g, group in enumerate(groups) for _ in group], dtype=torch.long),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        turn_rewards=turn_rewards, turn_mask=turn_mask,
        response_lengths=torch.tensor([t.response_length for t in trajectories], dtype=torch.float32),
        trained=torch.tensor(trained, dtype=torch.bool))
