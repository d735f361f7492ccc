"""Train/test splits and the order in which the training set is visited."""

import math
from collections.abc import Callable

import numpy as np
import torch

from RL2.config.errors import ConfigError
from RL2.datasets.loading import DataError, load_table, take
from RL2.datasets.tokenize import tokenize_rows
from RL2.utils.logging import log_rank0


def load_splits(data_cfg, make_tokenize_row: Callable, seed: int, blank_rows: dict[str, tuple[str, int | None]] |
                None = None, keep_row: bool = False) -> tuple[list, list]:
    """Tokenized train and test examples; `seed` holds out the same `test_ratio` rows on every rank and every
    run. `blank_rows`: split -> (config key, n): a split whose path is unset is n rows with no prompt, for an
    environment whose `reset` makes every prompt (the original RL2's Gym-like environments, which trained with
    no data). `keep_row`: each example keeps its row's number in its file as `row`."""
    train_rows = _rows_of(data_cfg.train.path, "train", blank_rows)
    if train_rows is None:
        raise ConfigError("data.train.path is not set; give the training rows, e.g. data.train.path=train.jsonl")
    test_cfg, numbers = data_cfg.test, {}
    if data_cfg.test_ratio > 0 and data_cfg.train.path and not data_cfg.test.path:
        numbers = held_out_split(len(train_rows), data_cfg.test_ratio, seed)
        if not all(numbers.values()):
            raise DataError(f"{data_cfg.train.path}: cannot hold out data.test_ratio={data_cfg.test_ratio} of its "
                            f"{len(train_rows)} rows ({len(numbers['train'])} would be left to train on, "
                            f"{len(numbers['test'])} to test); add rows, change data.test_ratio, or give "
                            f"data.test.path")
        train_rows, test_rows = take(train_rows, numbers["train"]), take(train_rows, numbers["test"])
        # Held-out rows are rows of the train file: read them with the train file's keys and settings.
        test_cfg = data_cfg.train
    else:
        test_rows = _rows_of(data_cfg.test.path, "test", blank_rows)
    source = data_cfg.train.path or "rows with no prompt"
    train, skipped = tokenize_rows(train_rows, make_tokenize_row(data_cfg.train), source, data_cfg.skip_bad_rows,
                                   numbers.get("train"), keep_row)
    test = []
    if test_rows is not None:
        source = data_cfg.test.path or (f"{data_cfg.train.path} (held-out {data_cfg.test_ratio:.0%})" if (
            data_cfg.train.path) else "rows with no prompt")
        test, test_skipped = tokenize_rows(test_rows, make_tokenize_row(test_cfg), source, data_cfg.skip_bad_rows,
                                           numbers.get("test"), keep_row)
        skipped += test_skipped
    if skipped:
        log_rank0(f"skipped {skipped} bad rows (data.skip_bad_rows=true)")
    log_rank0(f"data: {len(train)} train examples, {len(test)} test examples")
    return train, test


def held_out_split(n_rows: int, test_ratio: float, seed: int) -> dict[str, list[int]]:
    """The row numbers of each side of `test_ratio`, the rows of `datasets.Dataset.train_test_split(test_ratio,
    seed=seed)`: the first ceil(n_rows * test_ratio) of numpy's permutation of the rows are held out."""
    order = np.random.default_rng(seed).permutation(n_rows).tolist()
    n_test = math.ceil(test_ratio * n_rows)
    return {"train": order[n_test:], "test": order[:n_test]}


def _rows_of(path: str | None, split: str, blank_rows: dict | None) -> list | None:
    """The rows at `path`; with no path, the split's blank rows (`load_splits`), or None."""
    if path:
        return load_table(path)
    key, n = (blank_rows or {}).get(split, (None, None))
    if not n:
        return None
    log_rank0(f"data.{split}.path is unset: the {split} split is {key}={n} rows with no prompt, each made by the "
              f"environment's reset (as the original RL2 did)")
    return [{} for _ in range(n)]


class EpochSampler:
    """Which examples make up optimizer step `step`: a pure function of (seed, step), so that resuming needs
    only the step number, and every rank computes the same global batch."""

    def __init__(self, n_examples: int, batch_size: int, shuffle: bool, seed: int):
        if n_examples < batch_size:
            raise ConfigError(f"the training set has {n_examples} examples, fewer than "
                              f"data.train.batch_size={batch_size}; lower the batch size")
        self.n_examples, self.batch_size = n_examples, batch_size
        self.shuffle, self.seed = shuffle, seed
        self.steps_per_epoch = n_examples // batch_size  # the incomplete last batch is dropped

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.n_examples))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n_examples, generator=generator).tolist()

    def batch(self, step: int) -> list[int]:
        epoch, index = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[index * self.batch_size : (index + 1) * self.batch_size]


def batches(examples: list, batch_size: int):
    """Consecutive batches of a list (the last may be smaller): for evaluation."""
    for start in range(0, len(examples), batch_size):
        yield examples[start : start + batch_size]
