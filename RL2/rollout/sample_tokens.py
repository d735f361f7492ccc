"""The tokens `save_samples` writes with `rollout.save_sample_tokens`: what the viewer colours each token by."""

from RL2.batch import RolloutBatch
from RL2.rollout.trajectory import Trajectory


def sample_tokens(groups: list[list[Trajectory]], tokenizer, limit: int, trained: list[list[Trajectory]],
                  batch: RolloutBatch | None) -> list[dict]:
    """Each trajectory of `groups` (those written), its tokens after its prompts (at most `limit`), as the columns of
    docs/outputs.md; `adv` and `trainer_logp` (`old_logps`) for the `trained` groups (a subset) from `batch`, the
    trained batch after the update (None when nothing was trained)."""
    per_label = _per_token_values(trained, batch) if batch is not None else {}
    records = []
    for t in (t for group in groups for t in group):
        columns = {"mask": [], "logp": [], "version": [], "ids": []}
        trained_values = per_label.get(id(t))
        extra = {name: [] for name in (trained_values[0] if trained_values else {})}
        for index, (seq, record) in enumerate(zip(t.sequences, t.token_sequences())):
            start = len(seq.prompt_ids)
            columns["ids"] += record["input_ids"][start:]
            columns["mask"] += record["loss_mask"][start:]
            columns["logp"] += [_short(v) for v in record["engine_logps"][start:]]
            columns["version"] += record["versions"][start:]
            for name, values in extra.items():
                values += [None if v is None else _short(v) for v in trained_values[index][name][start:]]
        n_tokens = len(columns["ids"])
        ids = columns.pop("ids")[:limit]
        columns = {name: values[:limit] for name, values in (columns | extra).items()}
        records.append({"n_tokens": n_tokens, "text": tokenizer.batch_decode([[i] for i in ids])} | columns)
    return records


def _per_token_values(groups: list[list[Trajectory]], batch: RolloutBatch) -> dict[int, list[dict[str, list]]]:
    """id(trajectory) -> per sequence, the batch's `advantages` and `old_logps` at each token (None at the first,
    which is no label), in the order `training_batch` laid them out."""
    names = {"adv": "advantages", "trainer_logp": "old_logps"}
    columns = {name: batch.tokens[key].tolist() for name, key in names.items() if key in batch.tokens}
    offsets, index, found = batch.offsets.tolist(), 0, {}
    for t, trained in zip((t for group in groups for t in group), batch.trained.tolist()):
        sequences = []
        for record in t.token_sequences():
            if len(record["input_ids"]) < 2 or not trained:  # not in the batch
                sequences.append({name: [None] * len(record["input_ids"]) for name in columns})
                continue
            begin, end = offsets[index], offsets[index + 1]
            sequences.append({name: [None] + values[begin:end] for name, values in columns.items()})
            index += 1
        found[id(t)] = sequences
    return found


def _short(value: float) -> float:
    """Five significant digits: what a colour shows, in a third of the characters."""
    return float(f"{value:.5g}")
