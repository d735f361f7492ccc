"""Odds-ratio preference optimisation (Hong et al. 2024), no reference model:
`torchrun -m RL2.trainer.orpo data.train.path=pairs.jsonl actor.beta=0.1`."""

from RL2.algs.preference import orpo_loss
from RL2.config.schema import ORPOConfig
from RL2.models.logps import packed_logps
from RL2.trainer.base import launch
from RL2.trainer.pairwise import PairwiseTrainer, per_sequence_sum
from RL2.utils.plot import CurvePanel


class ORPOTrainer(PairwiseTrainer):
    learning_curve = (
        CurvePanel("loss and its SFT term (nll)", ("train/loss", "test/loss", "train/nll", "test/nll"), ylabel="loss"),
        CurvePanel("preference accuracy", ("train/accuracy", "test/accuracy"), ylim=(-0.02, 1.02)),
        CurvePanel("log odds ratio", ("train/log_odds", "test/log_odds"), ylabel="chosen - rejected log odds"),
    )

    def sequence_scores(self, mb):
        logps = packed_logps(self.worker.model, mb)
        n_tokens = per_sequence_sum(mb.loss_mask, mb)
        return {"avg_logps": per_sequence_sum(logps * mb.loss_mask, mb) / n_tokens.clamp(min=1)}

    def pair_losses(self, chosen, rejected):
        odds_ratio, metrics = orpo_loss(chosen["avg_logps"], rejected["avg_logps"], self.cfg.actor.beta)
        nll = -chosen["avg_logps"]  # the SFT term: mean per-token NLL of the chosen response
        metrics["nll"] = nll.detach()
        return nll + odds_ratio, metrics


def main(argv: list[str] | None = None) -> None:
    launch(ORPOTrainer, ORPOConfig, "orpo", argv)


if __name__ == "__main__":
    main()
