"""Pack variable-length sequences into padding-free micro-batches, balanced across ranks.

Every rank holds the same global batch, runs the same deterministic partition and keeps its own share: no
communication, and every rank gets the same number of micro-batches (as FSDP's collectives need).
"""

import heapq
import math
from itertools import accumulate

import torch

from RL2.algs.averaging import loss_weights
from RL2.batch import MicroBatch, RolloutBatch, SequenceBatch
from RL2.config.errors import ConfigError
from RL2.utils.shared_prefixes import compressed_length


def balanced_partition(sizes: list[int], n_parts: int) -> list[list[int]]:
    """Greedy longest-processing-time partition of item indices into `n_parts` groups of similar total size."""
    heap = [(0, part) for part in range(n_parts)]
    parts = [[] for _ in range(n_parts)]
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        load, part = heapq.heappop(heap)
        parts[part].append(index)
        heapq.heappush(heap, (load + sizes[index], part))
    return [sorted(p) for p in parts]


def plan_micro_batches(unit_sizes: list[int], dp_size: int, max_tokens: int, seq_parallel: int = 1,
                       budget_key: str = "actor.max_length_per_device",
                       unit_lengths: list[int] | None = None) -> list[list[list[int]]]:
    """Assign units to ranks, then to micro-batches of at most `max_tokens * seq_parallel`, the same count
    on every rank: plan[rank][micro_batch] = unit indices. `budget_key` and `unit_lengths` (the sequences
    of each unit) are for the error of a unit that cannot fit."""
    budget = max_tokens * seq_parallel
    too_long = [i for i, s in enumerate(unit_sizes) if s > budget]
    if too_long:
        longest = max(too_long, key=lambda i: unit_sizes[i])
        shared = f" x cp_size * tp_size={seq_parallel}" if seq_parallel > 1 else ""
        # A preference pair's two sides share a micro-batch: together they may not fit where each would.
        what = f"a sequence of {unit_sizes[longest]} tokens does"
        if unit_lengths and unit_lengths[longest] > 1:
            what = (f"{unit_lengths[longest]} sequences that must share a micro-batch (e.g. a preference pair's two "
                    f"sides) hold {unit_sizes[longest]} tokens together, which do")
        raise ConfigError(f"{what} not fit in {budget_key}={max_tokens}{shared}; raise {budget_key} (or cp_size) or "
                          "lower data.*.max_length")
    ranks = balanced_partition(unit_sizes, dp_size)
    n_micro = max(1, math.ceil(max(sum(unit_sizes[i] for i in r) for r in ranks) / budget))
    while True:
        plan = []
        for rank_units in ranks:
            bins = balanced_partition([unit_sizes[i] for i in rank_units], n_micro)
            plan.append([[rank_units[j] for j in b] for b in bins])
        if all(sum(unit_sizes[i] for i in b) <= budget for rank in plan for b in rank):
            return plan
        n_micro += 1


def pack(batch: SequenceBatch, dp_rank: int, dp_size: int, max_tokens: int, weights: torch.Tensor | None = None,
         units: list[list[int]] | None = None, seq_parallel: int = 1, unit_sizes: list[int] | None = None,
         budget_key: str = "actor.max_length_per_device") -> list[MicroBatch]:
    """This rank's micro-batches of the global `batch`, whose per-token tensors other than `loss_mask` become
    `extras`; the cp and tp ranks of one data-parallel rank get the same micro-batches and split each one.
    `weights`: loss weights (None: zeros, a pass without an averaged loss); `units`: groups of sequences that
    must share a micro-batch (e.g. a DPO pair); `unit_sizes`: the tokens each costs, default its labels."""
    if units is None:
        units = [[i] for i in range(len(batch.input_ids))]
    if weights is None:
        weights = torch.zeros(batch.n_labels)
    compressed = unit_sizes is not None  # sizes of rows with shared prefixes stored once
    if unit_sizes is None:
        unit_sizes = [sum(batch.label_counts[i] for i in unit) for unit in units]
    plan = plan_micro_batches(unit_sizes, dp_size, max_tokens, seq_parallel, budget_key, [len(u) for u in units])
    micro_batches = []
    for unit_ids in plan[dp_rank]:
        mb = _pack(batch, weights, [i for u in unit_ids for i in units[u]])
        if compressed:
            mb.unit_starts = list(accumulate((len(units[u]) for u in unit_ids[:-1]), initial=0))
        micro_batches.append(mb)
    return micro_batches


def prompt_group_units(batch: RolloutBatch, dp_size: int, budget: int) -> tuple[list[list[int]], list[int]]:
    """Packing units that keep a prompt group's sequences together, and what each costs with the prompt
    stored once (`RL2.models.shared_prefix`). A group is cut into chunks of whole trajectories: as many as it
    takes for every data-parallel rank to get work and for each chunk to fit `budget` tokens. A trajectory that
    alone exceeds the budget becomes one unit per sequence."""
    trajectories = batch.sample_sequences
    groups: list[list[list[int]]] = [[] for _ in range(batch.n_groups)]
    for sample, group in enumerate(batch.group_ids.tolist()):
        if trajectories[sample]:
            groups[group].append(trajectories[sample])
    groups = [g for g in groups if g]
    chunks_per_group = max(1, -(-dp_size // max(len(groups), 1)))
    units, sizes = [], []

    def size(unit: list[int]) -> int:
        return compressed_length([batch.input_ids[i] for i in unit])

    for group in groups:
        for n_chunks in range(min(chunks_per_group, len(group)), len(group) + 1):
            bounds = [round(k * len(group) / n_chunks) for k in range(n_chunks + 1)]  # parts differing by one at most
            chunks = [[i for t in group[a:b] for i in t] for a, b in zip(bounds[:-1], bounds[1:])]
            chunk_sizes = [size(chunk) for chunk in chunks]
            if max(chunk_sizes) <= budget or n_chunks == len(group):
                break
        for chunk, chunk_size in zip(chunks, chunk_sizes):
            pieces = [(chunk, chunk_size)] if chunk_size <= budget else [([i], size([i])) for i in chunk]
            units.extend(piece for piece, _ in pieces)
            sizes.extend(piece_size for _, piece_size in pieces)
    return units, sizes


def train_weights(batch: SequenceBatch, avg_level: str, response_budget: int | None = None) -> torch.Tensor:
    """The batch's loss weights at `avg_level` (`RL2.algs.averaging`), counting its samples (sequences, or
    RL trajectories, those trained); `response_budget` is the normaliser of avg_level=constant."""
    return loss_weights(batch.tokens["loss_mask"], batch.sample_of_label, batch.n_trained, avg_level, response_budget)


def _pack(batch: SequenceBatch, weights: torch.Tensor, sequence_ids: list[int]) -> MicroBatch:
    if not sequence_ids:
        # An empty bin still runs forward/backward so that every rank joins the same collectives:
        # one dummy token with zero weight.
        dummy = _pack(SequenceBatch(input_ids=[[0, 0]], tokens={"loss_mask": torch.zeros(1)}), torch.zeros(1), [0])
        dummy.sequence_ids = []
        return dummy
    seqs = [batch.input_ids[i] for i in sequence_ids]
    lens = [len(ids) - 1 for ids in seqs]
    labels = torch.cat([torch.arange(int(batch.offsets[i]), int(batch.offsets[i + 1])) for i in sequence_ids])

    def row(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).unsqueeze(0)

    return MicroBatch(
        input_ids=row([t for ids in seqs for t in ids[:-1]]),
        labels=row([t for ids in seqs for t in ids[1:]]),
        position_ids=row([p for n in lens for p in range(n)]),
        cu_seqlens=torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        loss_mask=batch.tokens["loss_mask"][labels].float().unsqueeze(0),
        loss_weights=weights[labels].float().unsqueeze(0),
        sequence_ids=list(sequence_ids),
        extras={name: values[labels].unsqueeze(0) for name, values in batch.tokens.items() if name != "loss_mask"},
    )
