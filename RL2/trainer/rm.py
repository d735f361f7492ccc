"""Bradley-Terry reward model: `torchrun -m RL2.trainer.rm data.train.path=pairs.jsonl critic.model_name=...`

A scalar head on the causal LM (PPO's critic's shape), read at the position that predicts a sequence's last
token (packed inputs are `input_ids[:-1]`); docs/trainers.md says how to score with the export."""

import torch

from RL2.algs.preference import bradley_terry_loss
from RL2.config.schema import RMConfig
from RL2.models.logps import forward_packed
from RL2.trainer.base import launch
from RL2.trainer.pairwise import PairwiseTrainer, last_token
from RL2.workers.fsdp import FSDPWorker, scalar_head_worker


class RMTrainer(PairwiseTrainer):
    model_key = "critic"

    def build_worker(self, model_cfg) -> FSDPWorker:
        worker = scalar_head_worker(model_cfg, self.dims, self.device, self.n_steps, section=self.model_key)
        # The Bradley-Terry loss does not change when every reward shifts by a constant, so the head's
        # bias gets only round-off gradients, which Adam would amplify into a random walk. Pin it at 0.
        bias = worker.model.score.bias
        if bias is not None:
            torch.nn.init.zeros_(bias).requires_grad_(False)
        return worker

    def sequence_scores(self, mb):
        return {"rewards": last_token(forward_packed(self.worker.model, mb).values(), mb)}

    def pair_losses(self, chosen, rejected):
        margin = (chosen["rewards"] - rejected["rewards"]).detach()
        metrics = {"accuracy": (margin > 0).float(), "margin": margin,
                   "chosen_rewards": chosen["rewards"].detach(), "rejected_rewards": rejected["rewards"].detach()}
        return bradley_terry_loss(chosen["rewards"], rejected["rewards"]), metrics


def main(argv: list[str] | None = None) -> None:
    launch(RMTrainer, RMConfig, "rm", argv)


if __name__ == "__main__":
    main()
