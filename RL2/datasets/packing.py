"""Pack variable-length examples into padding-free micro-batches, balanced across ranks.

Every rank holds the same global batch and runs the same deterministic partition, then keeps its
own share, so no communication is needed and every rank gets the same number of micro-batches
(FSDP's collectives need every rank to run the same number of forward/backward passes).

A packed micro-batch is one row of `T` tokens holding several sequences back to back. Attention
never crosses a sequence boundary: `cu_seqlens` marks the boundaries for the varlen attention, and
`position_ids` restart at 0 for every sequence.
"""

import heapq
import math
from dataclasses import dataclass, field

import torch


@dataclass
class MicroBatch:
    """Sequences packed into one row. Token tensors are `[1, T]`; token t predicts `labels[t]`.

    Attributes:
        input_ids: the states (tokens 0..L-2 of each sequence).
        labels: the actions (tokens 1..L-1), i.e. the next token at each position.
        position_ids: position within each sequence.
        cu_seqlens: int32 `[n + 1]` cumulative sequence lengths.
        loss_mask: 1.0 where `labels` is trained on.
        loss_weights: `loss_mask` scaled so that summing `loss * loss_weights` over every micro-batch
            of every rank gives the configured average over the global batch.
        example_ids: positions in the global batch of the packed sequences, in order.
        extras: more per-token `[1, T]` tensors aligned with `labels` (advantages, old logps, ...).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor
    loss_weights: torch.Tensor
    example_ids: list[int]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {k: v.to(device) for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        extras = {k: v.to(device) for k, v in self.extras.items()}
        return MicroBatch(**moved, example_ids=self.example_ids, extras=extras)

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def unpack(self, per_token: torch.Tensor) -> list[torch.Tensor]:
        """Split a `[1, T]` tensor back into one tensor per packed sequence."""
        return list(per_token.squeeze(0).split(self.seq_lens))


def sequence_weights(examples: list[dict], avg_level: str, constant: int | None = None) -> list[list[float]]:
    """Per-token loss weights over the whole global batch (aligned with `loss_mask[1:]`).

    token:    every trained token of the batch counts the same (sum / number of trained tokens);
    sequence: every sequence counts the same (mean within a sequence, then mean over sequences);
    constant: sum / (constant * number of sequences), Dr. GRPO's length-independent normaliser.
    """
    masks = [ex["loss_mask"][1:] for ex in examples]
    if avg_level == "token":
        total = max(sum(sum(m) for m in masks), 1)
        return [[v / total for v in m] for m in masks]
    if avg_level == "sequence":
        return [[v / (max(sum(m), 1) * len(masks)) for v in m] for m in masks]
    if avg_level == "constant":
        if not constant:
            raise ValueError("avg_level=constant needs a positive normaliser (the maximum response length)")
        return [[v / (constant * len(masks)) for v in m] for m in masks]
    raise ValueError(f"unknown avg_level '{avg_level}'; choose token, sequence or constant")


def balanced_partition(sizes: list[int], n_parts: int) -> list[list[int]]:
    """Greedy longest-processing-time partition of item indices into `n_parts` groups of similar total size."""
    heap = [(0, part) for part in range(n_parts)]
    parts = [[] for _ in range(n_parts)]
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        load, part = heapq.heappop(heap)
        parts[part].append(index)
        heapq.heappush(heap, (load + sizes[index], part))
    return [sorted(p) for p in parts]


def plan_micro_batches(unit_sizes: list[int], dp_size: int, max_tokens: int,
                       seq_parallel: int = 1) -> list[list[list[int]]]:
    """Assign units to ranks, then to micro-batches of at most `max_tokens * seq_parallel`, the same count
    on every rank.

    Returns:
        plan[rank][micro_batch] = unit indices.
    """
    budget = max_tokens * seq_parallel
    too_long = [s for s in unit_sizes if s > budget]
    if too_long:
        shared = f" x cp_size * tp_size={seq_parallel}" if seq_parallel > 1 else ""
        raise ValueError(
            f"a sequence of {max(too_long)} tokens does not fit in actor.max_length_per_device={max_tokens}{shared}; "
            f"raise actor.max_length_per_device (or cp_size) or lower data.*.max_length"
        )
    max_tokens = budget
    ranks = balanced_partition(unit_sizes, dp_size)
    n_micro = max(1, math.ceil(max(sum(unit_sizes[i] for i in r) for r in ranks) / max_tokens))
    while True:
        plan = []
        for rank_units in ranks:
            bins = balanced_partition([unit_sizes[i] for i in rank_units], n_micro)
            plan.append([[rank_units[j] for j in b] for b in bins])
        if all(sum(unit_sizes[i] for i in b) <= max_tokens for rank in plan for b in rank):
            return plan
        n_micro += 1


def pack_examples(
    examples: list[dict],
    dp_rank: int,
    dp_size: int,
    max_tokens: int,
    avg_level: str = "token",
    units: list[list[int]] | None = None,
    constant: int | None = None,
    seq_parallel: int = 1,
) -> list[MicroBatch]:
    """This rank's micro-batches for one global batch.

    Args:
        examples: the global batch; each has `input_ids` and `loss_mask`, and may have more per-token
            lists of the same length (they become `extras`, shifted like `loss_mask`).
        dp_rank, dp_size: this rank's position among the ranks that see different data (the cp and tp
            ranks of one data-parallel group get the same micro-batches and split each one).
        max_tokens: token budget of one micro-batch on one rank (`max_length_per_device`).
        avg_level: how losses are averaged over the global batch (see `sequence_weights`).
        units: groups of examples that must share a micro-batch (e.g. a DPO pair); default one each.
        constant: normaliser for avg_level=constant.
        seq_parallel: ranks that share each micro-batch (`cp * tp`, `ParallelDims.seq_parallel`); a
            micro-batch holds up to `max_tokens * seq_parallel` tokens.
    """
    if units is None:
        units = [[i] for i in range(len(examples))]
    weights = sequence_weights(examples, avg_level, constant)
    unit_sizes = [sum(len(examples[i]["input_ids"]) - 1 for i in unit) for unit in units]
    plan = plan_micro_batches(unit_sizes, dp_size, max_tokens, seq_parallel)
    micro_batches = []
    for unit_ids in plan[dp_rank]:
        example_ids = [i for u in unit_ids for i in units[u]]
        micro_batches.append(_pack(examples, weights, example_ids))
    return micro_batches


def _pack(examples: list[dict], weights: list[list[float]], example_ids: list[int]) -> MicroBatch:
    if not example_ids:
        # An empty bin still runs forward/backward so that every rank joins the same collectives:
        # one dummy token with zero weight.
        dummy = _pack([{"input_ids": [0, 0], "loss_mask": [0, 0]}], [[0.0]], [0])
        dummy.example_ids = []
        return dummy
    seqs = [examples[i] for i in example_ids]
    extra_keys = [k for k, v in seqs[0].items() if k not in ("input_ids", "loss_mask") and _is_per_token(v, seqs[0])]
    lens = [len(s["input_ids"]) - 1 for s in seqs]

    def cat(lists: list[list], dtype) -> torch.Tensor:
        return torch.tensor([v for values in lists for v in values], dtype=dtype).unsqueeze(0)

    return MicroBatch(
        input_ids=cat([s["input_ids"][:-1] for s in seqs], torch.long),
        labels=cat([s["input_ids"][1:] for s in seqs], torch.long),
        position_ids=cat([range(n) for n in lens], torch.long),
        cu_seqlens=torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        loss_mask=cat([s["loss_mask"][1:] for s in seqs], torch.float32),
        loss_weights=cat([weights[i] for i in example_ids], torch.float32),
        example_ids=list(example_ids),
        extras={k: cat([s[k][1:] for s in seqs], torch.float32) for k in extra_keys},
    )


def _is_per_token(value, example: dict) -> bool:
    return isinstance(value, list) and len(value) == len(example["input_ids"])

