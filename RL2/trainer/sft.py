"""Supervised fine-tuning: `torchrun --nproc_per_node=N -m RL2.trainer.sft data.train.path=... key=value ...`"""

import time

import torch

from RL2.batch import SequenceBatch
from RL2.config.schema import SFTConfig
from RL2.datasets.sft import sft_row_tokenizer
from RL2.datasets.splits import batches
from RL2.datasets.tokenize import BadRow
from RL2.models.logps import packed_logps
from RL2.packing import pack, train_weights
from RL2.rollout.tools.declared import fallback_messages, render_conversation, template_renders_tools
from RL2.rollout.tools.tool_calls import tool_call_parser
from RL2.trainer.base import Trainer, launch
from RL2.utils.plot import CurvePanel
from RL2.workers.fsdp import FSDPWorker, load_tokenizer


class SFTTrainer(Trainer):
    learning_curve = (CurvePanel("loss", ("train/loss", "test/loss"), ylabel="negative log-likelihood"),)

    def __init__(self, cfg):
        super().__init__(cfg, cfg.actor)
        self.tokenizer = load_tokenizer(cfg.actor, "actor")
        self.load_data(sft_rows(self.tokenizer))
        self.actor = FSDPWorker(cfg.actor, self.dims, self.device, self.n_steps, section="actor")

    def workers(self) -> dict:
        return {"actor": self.actor}

    def token_losses(self, mb) -> torch.Tensor:
        """Per-token loss `[1, T]`: the negative log-likelihood of each label."""
        return -packed_logps(self.actor.model, mb)

    def batch_loss(self, examples: list[dict], train: bool) -> tuple[float, int]:
        """(loss, tokens) of a global batch: `token_losses` averaged as actor.avg_level says; backward if `train`."""
        batch = SequenceBatch.from_examples(examples)
        micro_batches = pack(batch, self.dims.dp_rank, self.dims.dp, self.cfg.actor.max_length_per_device,
                             train_weights(batch, self.cfg.actor.avg_level), seq_parallel=self.dims.seq_parallel)

        def loss_fn(mb):
            loss = (self.token_losses(mb) * mb.loss_weights).sum()
            return loss, {"loss": loss.detach(), "tokens": mb.input_ids.numel()}

        totals = self.actor.run_micro_batches(micro_batches, loss_fn, train)
        return totals["loss"], int(totals["tokens"])

    def train_step(self, step: int) -> dict[str, float]:
        began = time.perf_counter()
        batch = [self.train_data[i] for i in self.sampler.batch(step - 1)]
        loss, n_tokens = self.batch_loss(batch, train=True)
        stats = self.actor.optimizer_step()
        return {"train/loss": loss, "train/grad_norm": stats["grad_norm"], "train/lr": stats["lr"],
                "train/tokens": n_tokens, "perf/tokens_per_s": n_tokens / (time.perf_counter() - began)}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if not self.test_data:
            return {}
        self.actor.model.eval()
        # Each batch's loss is its own average (actor.avg_level): weighed by what it averaged over (its trained
        # tokens, label-aligned as the batch reads them, or its examples), the test loss is the whole set's average.
        losses = []
        for batch in batches(self.test_data, max(self.cfg.data.test.batch_size, self.dims.dp)):
            n = sum(sum(ex["loss_mask"][1:]) for ex in batch) if self.cfg.actor.avg_level == "token" else len(batch)
            losses.append((self.batch_loss(batch, train=False)[0], n))
        self.actor.model.train()
        return {"test/loss": sum(loss * n for loss, n in losses) / max(sum(n for _, n in losses), 1)}


def sft_rows(tokenizer):
    """The row tokenizer of SFT (and distillation): `sft_row_tokenizer`, a conversation with tools rendered as the
    rollout does, in the format `rollout.tool_parser=auto` gives this tokenizer, tool_calls as the text the policy
    writes for them."""
    parser, native = tool_call_parser("auto", tokenizer), template_renders_tools(tokenizer)

    def for_row(specs: list):
        # Shown as written (the schemas of an environment's tools, `tool.schema`, are what the rollout shows).
        schemas = [spec if isinstance(spec, dict) and "function" in spec else {"type": "function", "function": spec}
                   for spec in specs]
        names = [schema["function"].get("name") if isinstance(schema["function"], dict) else None
                 for schema in schemas]
        for i, name in enumerate(names):
            if not isinstance(name, str) or not name:
                raise BadRow(f"the row's tool {i} has no name; write OpenAI schemas, {{\"type\": \"function\", "
                             f"\"function\": {{\"name\", \"description\", \"parameters\"}}}}")

        def render(messages: list[dict], add_generation_prompt: bool) -> str:
            sampled = [fallback_messages([m], None, parser)[0] if m.get("tool_calls") else m for m in messages]
            return render_conversation(tokenizer, sampled, schemas, parser, native,
                                       add_generation_prompt=add_generation_prompt)

        return names, render

    return sft_row_tokenizer(tokenizer, for_row)


def main(argv: list[str] | None = None) -> None:
    launch(SFTTrainer, SFTConfig, "sft", argv)


if __name__ == "__main__":
    main()
