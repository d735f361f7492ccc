"""Direct preference optimisation: `torchrun -m RL2.trainer.dpo data.train.path=pairs.jsonl actor.beta=0.1`.

The reference is the actor's initial weights, frozen (with LoRA, the actor's base with its adapters off)."""

import torch

from RL2.algs.preference import dpo_loss
from RL2.config.schema import DPOConfig
from RL2.models.logps import packed_logps
from RL2.models.lora import adapters_disabled
from RL2.trainer.base import launch
from RL2.trainer.pairwise import PairwiseTrainer, per_sequence_sum
from RL2.workers.fsdp import FSDPWorker


class DPOTrainer(PairwiseTrainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.ref = None if self.worker.lora else FSDPWorker(cfg.actor, self.dims, self.device, train=False,
                                                            section="actor")

    def sequence_scores(self, mb):
        with torch.no_grad(), adapters_disabled(self.worker.model):  # a no-op without LoRA, where self.ref is a copy
            ref_logps = packed_logps(self.worker.model if self.ref is None else self.ref.model, mb)
        logps = packed_logps(self.worker.model, mb)
        return {"logps": per_sequence_sum(logps * mb.loss_mask, mb), "n_tokens": per_sequence_sum(mb.loss_mask, mb),
                "ref_logps": per_sequence_sum(ref_logps * mb.loss_mask, mb)}

    def pair_losses(self, chosen, rejected):
        actor = self.cfg.actor
        # IPO regresses a margin of 1/(2 beta) that should not depend on length: average per token.
        normalise = (lambda side, key: side[key] / side["n_tokens"]) if actor.loss_type == "ipo" else (
            lambda side, key: side[key])
        losses, metrics = dpo_loss(normalise(chosen, "logps"), normalise(rejected, "logps"),
                                   normalise(chosen, "ref_logps"), normalise(rejected, "ref_logps"),
                                   beta=actor.beta, loss_type=actor.loss_type, label_smoothing=actor.label_smoothing)
        metrics["chosen_logps"] = chosen["logps"].detach()
        metrics["rejected_logps"] = rejected["logps"].detach()
        return losses, metrics


def main(argv: list[str] | None = None) -> None:
    launch(DPOTrainer, DPOConfig, "dpo", argv)


if __name__ == "__main__":
    main()
