"""Shared loop of the preference trainers (DPO, ORPO, reward model): a pair's sequences share a micro-batch,
so a subclass says what it reads off each sequence (`sequence_scores`) and how a pair becomes a loss."""

from collections import defaultdict

import torch

from RL2.batch import MicroBatch, SequenceBatch
from RL2.datasets.pairs import flatten_pairs, pair_row_tokenizer
from RL2.datasets.splits import batches
from RL2.packing import pack
from RL2.trainer.base import Trainer
from RL2.utils.plot import CurvePanel
from RL2.workers.fsdp import FSDPWorker, load_tokenizer


def per_sequence_sum(values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """`[1, T]` per-token values -> `[n_sequences]` sums, differentiable."""
    return torch.stack([chunk.sum() for chunk in mb.unpack(values)])


def last_token(values: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """`[1, T]` per-token values -> `[n_sequences]` value at each sequence's last position."""
    return values.squeeze(0)[mb.cu_seqlens[1:].long() - 1]


class PairwiseTrainer(Trainer):
    model_key = "actor"  # which config section holds the trained model
    learning_curve = (
        CurvePanel("loss", ("train/loss", "test/loss")),
        CurvePanel("preference accuracy", ("train/accuracy", "test/accuracy"), ylim=(-0.02, 1.02)),
        CurvePanel("reward margin", ("train/margin", "test/margin"), ylabel="chosen - rejected reward"),
    )

    def __init__(self, cfg):
        model_cfg = cfg[self.model_key]
        super().__init__(cfg, model_cfg)
        self.tokenizer = load_tokenizer(model_cfg, self.model_key)
        self.load_data(pair_row_tokenizer(self.tokenizer))
        self.worker = self.build_worker(model_cfg)

    # --- what a preference trainer defines ------------------------------------------------------
    def build_worker(self, model_cfg) -> FSDPWorker:
        return FSDPWorker(model_cfg, self.dims, self.device, self.n_steps, section=self.model_key)

    def sequence_scores(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        """Per-sequence tensors `[n_sequences]` in packing order (chosen, rejected, chosen, ...)."""
        raise NotImplementedError

    def pair_losses(self, chosen: dict, rejected: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss per pair, metrics per pair) from the two sides' `sequence_scores`."""
        raise NotImplementedError

    # --- shared ---------------------------------------------------------------------------------
    def workers(self) -> dict:
        return {self.model_key: self.worker}

    def pairs_pass(self, pairs: list[dict], train: bool) -> dict[str, float]:
        """Loss (and backward when training) over a global batch of pairs; metrics averaged over pairs."""
        examples, units = flatten_pairs(pairs)
        micro_batches = pack(SequenceBatch.from_examples(examples), self.dims.dp_rank, self.dims.dp,
                             self.cfg[self.model_key].max_length_per_device, units=units,
                             seq_parallel=self.dims.seq_parallel, budget_key=f"{self.model_key}.max_length_per_device")

        def loss_fn(mb):
            scores = self.sequence_scores(mb)
            if not mb.sequence_ids:  # a padding micro-batch: no pairs, but backward must still run on every rank
                return sum(v.sum() for v in scores.values()) * 0.0, {}
            losses, metrics = self.pair_losses({k: v[0::2] for k, v in scores.items()},
                                               {k: v[1::2] for k, v in scores.items()})
            return losses.sum() / len(pairs), {"loss": losses.sum().detach()} | {k: v.sum() for k, v in metrics.items()}

        totals = self.worker.run_micro_batches(micro_batches, loss_fn, train)
        return {key: value / len(pairs) for key, value in sorted(totals.items())}

    def train_step(self, step: int) -> dict[str, float]:
        pairs = [self.train_data[i] for i in self.sampler.batch(step - 1)]
        metrics = {f"train/{k}": v for k, v in self.pairs_pass(pairs, train=True).items()}
        stats = self.worker.optimizer_step()
        return {**metrics, "train/grad_norm": stats["grad_norm"], "train/lr": stats["lr"]}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if not self.test_data:
            return {}
        self.worker.model.eval()
        totals = defaultdict(float)
        for pairs in batches(self.test_data, max(self.cfg.data.test.batch_size, self.dims.dp)):
            for key, value in self.pairs_pass(pairs, train=False).items():
                totals[key] += value * len(pairs)
        self.worker.model.train()
        return {f"test/{k}": v / len(self.test_data) for k, v in totals.items()}
