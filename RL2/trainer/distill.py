"""Teacher-student distillation on a dataset: the student matches the teacher's whole next-token
distribution on the dataset's response tokens.

`torchrun -m RL2.trainer.distill data.train.path=sft.jsonl actor.model_name=STUDENT actor.teacher_name=TEACHER`

`actor.kl=forward` minimises KL(teacher || student) (mode covering, classic knowledge distillation);
`reverse` minimises KL(student || teacher) (mode seeking, as in MiniLLM / on-policy distillation).
Both models must share a tokenizer.
"""

import torch

from RL2.config.schema import DistillConfig
from RL2.models.logps import forward_packed
from RL2.models.vocab_parallel import VocabShard
from RL2.trainer.base import launch
from RL2.trainer.sft import SFTTrainer
from RL2.utils.plot import CurvePanel
from RL2.workers.fsdp import FSDPWorker


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, direction: str, temperature: float,
             vocab: VocabShard | None = None):
    """Per-token KL between the two distributions over the vocabulary, `[..., V] -> [...]`.

    Scaled by temperature^2 so that gradient sizes do not shrink as the temperature grows (Hinton et al. 2015).
    `vocab` says which slice of the vocabulary the logits cover under tensor parallelism.
    """
    vocab = vocab or VocabShard()
    student = vocab.log_softmax(student_logits.float() / temperature)
    teacher = vocab.log_softmax(teacher_logits.float() / temperature)
    log_p, log_q = (teacher, student) if direction == "forward" else (student, teacher)
    return vocab.sum(log_p.exp() * (log_p - log_q)) * temperature**2


class DistillTrainer(SFTTrainer):
    learning_curve = (CurvePanel("loss", ("train/loss", "test/loss"), ylabel="KL to the teacher per token"),)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.teacher = FSDPWorker(cfg.actor, self.dims, self.device, train=False, model_name=cfg.actor.teacher_name)

    def token_losses(self, mb) -> torch.Tensor:
        with torch.no_grad():
            teacher = forward_packed(self.teacher.model, mb, trained_only=True)
        student = forward_packed(self.actor.model, mb, trained_only=True)
        # Both are split alike (one layout per run): reduce the local slices, then gather the tokens.
        kl = token_kl(student.local_logits, teacher.local_logits, self.cfg.actor.kl, self.cfg.actor.temperature,
                      student.vocab)
        return student.gather(kl)


def main(argv: list[str] | None = None) -> None:
    launch(DistillTrainer, DistillConfig, "distill", argv)


if __name__ == "__main__":
    main()
