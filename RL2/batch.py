"""The batch types the packer, the models, the workers and the RL estimators share.

A `SequenceBatch` holds token sequences, unpadded: sequence i (`input_ids[i]`, L_i tokens) has L_i - 1 labels
(position t predicts token t + 1), and every per-token tensor holds all sequences' labels back to back
(`tokens[name][offsets[i]:offsets[i + 1]]` is sequence i's). A *sample* is what averages and baselines count
as one: a sequence for SFT and preference data; under RL a trajectory (`RolloutBatch`), whose sequences are
consecutive, so that its returns flow across them and a group baseline counts it once. A `MicroBatch` is what
one forward pass sees: some sequences of a batch packed into one row.
"""

from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import Tensor


@dataclass(kw_only=True)
class SequenceBatch:
    """Sequences with per-label values, grouped into samples."""

    input_ids: list[list[int]]  # each sequence's tokens, at least 2 of them
    # name -> `[n_labels]`, all sequences' labels back to back; always has `loss_mask` (1.0 on trained labels)
    tokens: dict[str, Tensor]
    # `[S]` long, each sequence's sample, non-decreasing (a sample's sequences are consecutive); default: one each
    sample_ids: Tensor | None = None
    # a sample may have no sequence (nothing to train on) and still count; default: the last sample id + 1
    n_samples: int | None = None

    def __post_init__(self):
        if self.sample_ids is None:
            self.sample_ids = torch.arange(len(self.input_ids))
        if self.n_samples is None:
            self.n_samples = int(self.sample_ids[-1]) + 1 if len(self.sample_ids) else 0
        if any(len(ids) < 2 for ids in self.input_ids):
            raise ValueError("every sequence needs at least 2 tokens (one label)")
        for name, values in self.tokens.items():
            if values.shape != (self.n_labels,):
                raise ValueError(f"tokens[{name!r}] has shape {tuple(values.shape)}; expected ({self.n_labels},)")

    @classmethod
    def from_examples(cls, examples: list[dict]) -> "SequenceBatch":
        """Tokenized examples, one sample each: `input_ids`, `loss_mask` and any other per-token list of
        the same length (`x[t]` about token t, so `x[0]` is dropped), e.g. as the datasets write them."""
        names = [k for k, v in examples[0].items() if k != "input_ids" and isinstance(v, list)
                 and len(v) == len(examples[0]["input_ids"])]
        tokens = {name: torch.tensor([v for ex in examples for v in ex[name][1:]], dtype=torch.float32)
                  for name in names}
        return cls(input_ids=[list(ex["input_ids"]) for ex in examples], tokens=tokens)

    @property
    def n_trained(self) -> int:
        """The samples a loss averages over (RolloutBatch leaves out the trajectories it does not train)."""
        return self.n_samples

    def __len__(self) -> int:
        """The number of sequences."""
        return len(self.input_ids)

    @cached_property
    def label_counts(self) -> list[int]:
        return [len(ids) - 1 for ids in self.input_ids]

    @property
    def n_labels(self) -> int:
        return sum(self.label_counts)

    @cached_property
    def offsets(self) -> Tensor:
        """`[S + 1]`: sequence i's labels are `[offsets[i], offsets[i + 1])`."""
        return torch.tensor([0] + self.label_counts).cumsum(0)

    @cached_property
    def sample_offsets(self) -> Tensor:
        """`[n_samples + 1]`: sample k's labels (all its sequences) are `[sample_offsets[k], sample_offsets[k + 1])`."""
        per_sample = torch.bincount(self.sample_of_label, minlength=self.n_samples)
        return torch.cat([torch.zeros(1, dtype=torch.long), per_sample.cumsum(0)])

    @cached_property
    def sample_of_label(self) -> Tensor:
        """`[n_labels]` long: the sample each label belongs to."""
        return torch.repeat_interleave(self.sample_ids, torch.tensor(self.label_counts, dtype=torch.long))

    @cached_property
    def sample_sequences(self) -> list[list[int]]:
        """The sequences of each sample, in order (none for a sample without any)."""
        sequences: list[list[int]] = [[] for _ in range(self.n_samples)]
        for sequence, sample in enumerate(self.sample_ids.tolist()):
            sequences[sample].append(sequence)
        return sequences

    def sequence(self, name: str, i: int) -> Tensor:
        """Sequence i's labels of `tokens[name]`."""
        return self.tokens[name][self.offsets[i] : self.offsets[i + 1]]

    def sample_sums(self, values: Tensor) -> Tensor:
        """`[n_labels]` -> `[n_samples]`: the sum over each sample's labels."""
        return torch.zeros(self.n_samples, dtype=values.dtype).index_add_(0, self.sample_of_label, values)

    def sample_rows(self, values: Tensor) -> Tensor:
        """`[n_labels]` -> `[n_samples, longest sample]`: each sample's labels in one row (its sequences
        one after the other), 0 after its end."""
        lengths = self.sample_offsets.diff()
        rows = values.new_zeros(self.n_samples, int(lengths.max()) if self.n_samples else 0)
        rows[self._row_index()] = values
        return rows

    def from_sample_rows(self, rows: Tensor) -> Tensor:
        """The inverse of `sample_rows`: `[n_samples, T]` -> `[n_labels]`."""
        return rows[self._row_index()]

    def _row_index(self) -> tuple[Tensor, Tensor]:
        samples = self.sample_of_label
        return samples, torch.arange(self.n_labels) - self.sample_offsets[samples]

    def select_samples(self, samples: list[int]) -> "SequenceBatch":
        """The batch of these samples only (in their order), renumbered from 0."""
        sequences = [self.sample_sequences[s] for s in samples]
        keep = [i for seqs in sequences for i in seqs]
        labels = torch.cat([torch.arange(int(self.offsets[i]), int(self.offsets[i + 1])) for i in keep]) if keep else (
            torch.zeros(0, dtype=torch.long))
        return replace(
            self,
            input_ids=[self.input_ids[i] for i in keep],
            tokens={name: values[labels] for name, values in self.tokens.items()},
            sample_ids=torch.tensor([new for new, seqs in enumerate(sequences) for _ in seqs], dtype=torch.long),
            n_samples=len(samples),
            **self._select_per_sample(torch.tensor(samples, dtype=torch.long)),
        )

    def _select_per_sample(self, samples: Tensor) -> dict:
        """Per-sample fields of a subclass, indexed by `samples`."""
        return {}


@dataclass(kw_only=True)
class RolloutBatch(SequenceBatch):
    """A rollout: groups (one prompt each) of trajectories (the samples) of sequences.

    Tokens: `loss_mask` (1.0 on sampled tokens), `engine_logps` (the engine's log-probability of each
    sampled token), `turn_ids` (long: the turn of the trajectory each sampled token belongs to, -1
    elsewhere); the trainer adds `old_logps`, `ref_logps`, `values`, `advantages`, `returns`, ...
    """

    group_ids: Tensor  # `[n_samples]` long, each trajectory's group, non-decreasing from 0
    rewards: Tensor  # `[n_samples]` each trajectory's reward (the sum of its turn rewards)
    turn_rewards: Tensor  # `[n_samples, K]` each turn's reward, 0 on padding turns
    turn_mask: Tensor  # `[n_samples, K]` 1.0 on real turns
    response_lengths: Tensor  # `[n_samples]` sampled tokens of each trajectory
    # `[n_samples]` bool: False for a trajectory left out of training (a fault, docs/rl.md), which has no
    # sequence and no part in its group's statistics or the loss's averages; default all True
    trained: Tensor | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.trained is None:
            self.trained = torch.ones(self.n_samples, dtype=torch.bool)

    @classmethod
    def single_turn(cls, examples: list[dict], group_ids: list[int],
                    rewards: list[float] | None = None) -> "RolloutBatch":
        """One-turn trajectories written as tokenized examples (`SequenceBatch.from_examples`), for
        benchmarks and tests of the update."""
        n = len(examples)
        rewards = torch.tensor(rewards if rewards is not None else [0.0] * n, dtype=torch.float32)
        batch = SequenceBatch.from_examples(examples)
        tokens = batch.tokens | {"turn_ids": torch.where(batch.tokens["loss_mask"] > 0, 0, -1)}
        return cls(input_ids=batch.input_ids, tokens=tokens, group_ids=torch.tensor(group_ids, dtype=torch.long),
                   rewards=rewards, turn_rewards=rewards[:, None].clone(), turn_mask=torch.ones(n, 1),
                   response_lengths=batch.sample_sums(batch.tokens["loss_mask"]))

    @property
    def n_trained(self) -> int:
        return int(self.trained.sum())

    @property
    def n_groups(self) -> int:
        return int(self.group_ids[-1]) + 1 if len(self.group_ids) else 0

    @property
    def group_size(self) -> int:
        """Trajectories per prompt group: the same for every group of a rollout."""
        sizes = torch.bincount(self.group_ids)
        if len(sizes) and not (sizes == sizes[0]).all():
            raise ValueError(f"the groups of a rollout hold {sorted(set(sizes.tolist()))} trajectories; they must "
                             f"all hold rollout.responses_per_prompt")
        return int(sizes[0]) if len(sizes) else 0

    def add_rewards(self, extra: Tensor) -> None:
        """Add `[n_samples]` to each trajectory's reward, once: to its total and to its last turn."""
        self.rewards = self.rewards + extra
        last_turn = (self.turn_mask.sum(1).long() - 1).clamp(min=0)
        self.turn_rewards = self.turn_rewards.index_put(
            (torch.arange(self.n_samples), last_turn), extra, accumulate=True)

    def mini_batches(self, groups_per_batch: int | None) -> list["RolloutBatch"]:
        """Split into batches of `groups_per_batch` whole groups, in order (None: one batch)."""
        if not groups_per_batch or groups_per_batch >= self.n_groups:
            return [self]
        batches = []
        for first in range(0, self.n_groups, groups_per_batch):
            in_batch = (self.group_ids >= first) & (self.group_ids < first + groups_per_batch)
            batches.append(self.select_samples(in_batch.nonzero()[:, 0].tolist()))
        return batches

    def _select_per_sample(self, samples: Tensor) -> dict:
        groups = self.group_ids[samples]
        per_sample = ("rewards", "turn_rewards", "turn_mask", "response_lengths", "trained")
        selected = {name: getattr(self, name)[samples] for name in per_sample}
        return selected | {"group_ids": groups - groups.min() if len(groups) else groups}


@dataclass
class MicroBatch:
    """Sequences packed into one row. Token tensors are `[1, T]`; token t predicts `labels[t]`."""

    input_ids: Tensor  # the states (tokens 0..L-2 of each sequence)
    labels: Tensor  # the actions (tokens 1..L-1), i.e. the next token at each position
    position_ids: Tensor  # position within each sequence
    cu_seqlens: Tensor  # int32 `[n + 1]` cumulative sequence lengths, which keep attention within each one
    loss_mask: Tensor  # 1.0 where `labels` is trained on
    loss_weights: Tensor  # each label's weight in the configured average over the global batch (`RL2.algs.averaging`)
    sequence_ids: list[int]  # the positions in their `SequenceBatch` of the packed sequences, in order
    extras: dict[str, Tensor] = field(default_factory=dict)  # the batch's other per-token tensors
    # the packed sequences (indices in this row) that begin a packing unit sized by its own shared-prefix
    # length (`prompt_group_units`): a shared-prefix run starts anew there
    unit_starts: list[int] = field(default_factory=list)

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, Tensor)}
        return replace(self, **moved, extras={k: v.to(device) for k, v in self.extras.items()})

    def extra(self, name: str) -> Tensor:
        """A per-token extra; zeros for the padding micro-batch, which has none."""
        return self.extras.get(name, torch.zeros_like(self.loss_mask))

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def unpack(self, per_token: Tensor) -> list[Tensor]:
        """Split a `[1, T]` tensor back into one tensor per packed sequence."""
        return list(per_token.squeeze(0).split(self.seq_lens))
