"""Runs of consecutive token sequences that share a prefix: which sequences of a packed row store their
common prefix once (`RL2.models.shared_prefix`, whose attention reads them) and how long the row is then
(`RL2.packing`, which balances rows by it). Plain lists of token ids, no tensors.
"""

# A shorter shared prefix is not worth the extra attention calls.
MIN_SHARED_TOKENS = 16


def common_prefix_length(sequences: list[list[int]]) -> int:
    """How many leading tokens all `sequences` share."""
    first = sequences[0]
    length = min(len(s) for s in sequences)
    for other in sequences[1:]:
        length = next((i for i in range(length) if other[i] != first[i]), length)
    return length


def compressed_length(sequences: list[list[int]]) -> int:
    """Positions of the compressed row of these sequences, packed in this order (full token lists)."""
    return sum(shared + sum(len(sequences[i]) - 1 - shared for i in run)
               for run, shared in runs_with_shared_prefix(sequences))


def runs_with_shared_prefix(sequences: list[list[int]], starts: set[int] = frozenset()) -> list[tuple[list[int], int]]:
    """Split consecutive sequences into runs, each with the number of positions (inputs: n for n+1 tokens) its
    sequences share; a run of one shares all of them. A sequence joins the current run while the run's shared
    positions times the sequences that reuse them does not drop and stays at least `MIN_SHARED_TOKENS`; a
    sequence in `starts` begins a new one."""
    runs: list[tuple[list[int], int]] = []
    for index, tokens in enumerate(sequences):
        if runs and index not in starts:
            run, shared = runs[-1]
            first = sequences[run[0]]
            with_this = min(shared, common_prefix_length([first, tokens]) - 1, len(tokens) - 1)
            if with_this >= MIN_SHARED_TOKENS and with_this * len(run) >= shared * (len(run) - 1):
                runs[-1] = (run + [index], with_this)
                continue
        runs.append(([index], len(tokens) - 1))
    return runs
