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
from RL2.trainer.base import launch
from RL2.trainer.sft import SFTTrainer
from RL2.workers.fsdp import FSDPWorker


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, direction: str, temperature: float):
    """Per-token KL between the two distributions over the vocabulary, `[..., V] -> [...]`.

    Scaled by temperature^2 so that gradient sizes do not shrink as the temperature grows (Hinton et al. 2015).
    """
    student = (student_logits.float() / temperature).log_softmax(-1)
    teacher = (teacher_logits.float() / temperature).log_softmax(-1)
    log_p, log_q = (teacher, student) if direction == "forward" else (student, teacher)
    return (log_p.exp() * (log_p - log_q)).sum(-1) * temperature**2


class DistillTrainer(SFTTrainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.teacher = FSDPWorker(cfg.actor, self.dims, self.device, train=False, model_name=cfg.actor.teacher_name)

    def token_losses(self, mb) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = forward_packed(self.teacher.model, mb).logits
        student_logits = forward_packed(self.actor.model, mb).logits
        return token_kl(student_logits, teacher_logits, self.cfg.actor.kl, self.cfg.actor.temperature)


def main(argv: list[str] | None = None) -> None:
    launch(DistillTrainer, DistillConfig, "distill", argv)


if __name__ == "__main__":
    main()
