"""Teacher-student distillation on a dataset (docs/trainers.md): the student matches the teacher's whole
next-token distribution on the response tokens; `actor.kl=reverse` is mode seeking, as in MiniLLM:
`torchrun -m RL2.trainer.distill data.train.path=sft.jsonl actor.model_name=STUDENT actor.teacher_name=TEACHER`"""

import torch

from RL2.config import ConfigError
from RL2.config.schema import DistillConfig
from RL2.models.logps import forward_packed
from RL2.models.vocab_parallel import VocabShard
from RL2.trainer.base import launch
from RL2.trainer.sft import SFTTrainer
from RL2.utils.plot import CurvePanel
from RL2.workers.fsdp import FSDPWorker


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, direction: str, temperature: float,
             vocab: VocabShard):
    """Per-token KL between the two distributions over the vocabulary, `[..., V] -> [...]`, times temperature^2 so
    that gradients do not shrink as the temperature grows (Hinton et al. 2015). `vocab`: the logits' slice (TP)."""
    student = vocab.log_softmax(student_logits.float() / temperature)
    teacher = vocab.log_softmax(teacher_logits.float() / temperature)
    log_p, log_q = (teacher, student) if direction == "forward" else (student, teacher)
    return vocab.sum(log_p.exp() * (log_p - log_q)) * temperature**2


class DistillTrainer(SFTTrainer):
    learning_curve = (CurvePanel("loss", ("train/loss", "test/loss"), ylabel="KL to the teacher per token"),)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.teacher = FSDPWorker(cfg.actor, self.dims, self.device, train=False, model_name=cfg.actor.teacher_name,
                                   section="actor")
        self.vocab_size = shared_vocabulary(self.actor.model.config.vocab_size, self.teacher.model.config.vocab_size,
                                            len(self.tokenizer), self.dims.tp)

    def token_losses(self, mb) -> torch.Tensor:
        with torch.no_grad():
            teacher = forward_packed(self.teacher.model, mb, trained_only=True)
        student = forward_packed(self.actor.model, mb, trained_only=True)
        student_logits, teacher_logits = student.local_logits, teacher.local_logits
        if self.vocab_size is not None:
            student_logits = student_logits[..., :self.vocab_size]
            teacher_logits = teacher_logits[..., :self.vocab_size]
        # Both are split alike (one layout per run): reduce the local slices, then gather the tokens.
        kl = token_kl(student_logits, teacher_logits, self.cfg.actor.kl, self.cfg.actor.temperature, student.vocab)
        return student.gather(kl)


def shared_vocabulary(student_rows: int, teacher_rows: int, n_tokens: int, tp_size: int) -> int | None:
    """How many logits of each model to compare: None (all) when the output layers match, else the tokenizer's
    tokens, which both must cover (the rows beyond are padding neither model is trained to produce)."""
    if student_rows == teacher_rows:
        return None
    sizes = f"the student's output layer has {student_rows} rows, the teacher's {teacher_rows}"
    if n_tokens > min(student_rows, teacher_rows):
        raise ConfigError(f"actor.teacher_name: {sizes}, fewer than the tokenizer's {n_tokens} tokens: the "
                          f"models do not share a tokenizer; pick a teacher of the student's family")
    if tp_size > 1:
        raise ConfigError(f"actor.teacher_name: {sizes}, so their vocabularies split differently over "
                          f"actor.tp_size={tp_size}; distil with actor.tp_size=1")
    return n_tokens


def main(argv: list[str] | None = None) -> None:
    launch(DistillTrainer, DistillConfig, "distill", argv)


if __name__ == "__main__":
    main()
