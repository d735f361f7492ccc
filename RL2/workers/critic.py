"""PPO's models with a scalar head on every token: the value model (`Critic`) and the frozen reward model
(`RewardModel`). `values[t]` (aligned with the labels) is the head's output at the position predicting token t."""

import torch

from RL2.algs.value_loss import value_loss
from RL2.batch import MicroBatch, RolloutBatch, SequenceBatch
from RL2.models.logps import forward_packed
from RL2.packing import train_weights
from RL2.parallel import ParallelDims
from RL2.workers.actor import pack_for, per_token_pass, update_passes, weighted_means
from RL2.workers.fsdp import scalar_head_worker

BUDGET_KEY = "critic.max_length_per_device"  # the critic's micro-batch budget, named in packing errors


class Critic:
    """Args as `RL2.workers.actor.Actor`; `cfg` is the `critic` config."""

    def __init__(self, cfg, dims: ParallelDims, device: torch.device, total_steps: int,
                 response_budget: int | None = None):
        self.cfg, self.dims, self.device, self.response_budget = cfg, dims, device, response_budget
        self.worker = scalar_head_worker(cfg, dims, device, total_steps, section="critic")
        self.model = self.worker.model
        # A random head would start GAE from noisy values; from zero, the first advantages are the plain returns.
        # A head saved with the checkpoint (`...ForTokenClassification`, as RL2 exports them) was trained: it stays.
        if not any(name.endswith("ForTokenClassification") for name in self.model.config.architectures or []):
            for param in self.model.score.parameters():
                torch.nn.init.zeros_(param)

    def forward_values(self, mb: MicroBatch) -> torch.Tensor:
        return forward_packed(self.model, mb).values()

    @torch.no_grad()
    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """`[n_labels]` the value of the state before each label."""
        return per_token_pass(self.worker, batch, self.forward_values, BUDGET_KEY)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Regress `values` towards `returns` (both per token in the batch), clipped around the old values."""
        return update_passes(self.cfg, batch, self._step, "critic")

    def _step(self, batch: RolloutBatch) -> dict[str, float]:
        weights = train_weights(batch, self.cfg.avg_level, self.response_budget)
        micro = pack_for(self.model, batch, self.dims, self.cfg.max_length_per_device, weights, budget_key=BUDGET_KEY)
        totals = self.worker.run_micro_batches(micro, self._micro_batch_loss)
        stats = self.worker.optimizer_step()
        return weighted_means(totals) | {"grad_norm": stats["grad_norm"]}

    def _micro_batch_loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        values = self.forward_values(mb)
        losses = value_loss(values, mb.extra("values"), mb.extra("returns"), mb.loss_weights, clip=self.cfg.value_clip)
        loss = (losses * mb.loss_weights).sum()
        return loss, {"loss": loss.detach(), "value_mean": (values.detach() * mb.loss_weights).sum(),
                      "weight": mb.loss_weights.sum()}


class RewardModel:
    """The frozen reward model of `rollout.reward_model`, whose score PPO adds to the environment's reward.
    `cfg` is the `critic` config (dtype, micro-batch budget); args otherwise as `Critic`'s."""

    def __init__(self, cfg, dims: ParallelDims, device: torch.device, model_name: str):
        self.worker = scalar_head_worker(cfg, dims, device, train=False, model_name=model_name, section="critic")
        self.model = self.worker.model

    @torch.no_grad()
    def scores(self, batch: SequenceBatch) -> torch.Tensor:
        """`[n_samples]` each trajectory's score: the head at the last position of its last sequence, as trained."""
        per_token = per_token_pass(self.worker, batch, lambda mb: forward_packed(self.model, mb).values(), BUDGET_KEY)
        last = batch.sample_offsets[1:] - 1
        has_tokens = batch.sample_offsets.diff() > 0
        return torch.where(has_tokens, per_token[last.clamp(min=0)], 0.0)
