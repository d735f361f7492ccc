"""Forward a packed micro-batch and read off per-token log-probabilities, entropies or values.

Under tensor parallelism each rank holds the logits of a slice of the vocabulary; under context
parallelism, of a share of the tokens. `PackedForward` hides both: its methods reduce over the
vocabulary on the local logits (`RL2.models.vocab_parallel`), then gather the per-token results
over the cp ranks, so callers always get whole `[1, T]` rows, aligned with the micro-batch's labels.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from RL2.algs.policy_loss import entropy_from_logits
from RL2.datasets.packing import MicroBatch
from RL2.models.context_parallel import ContextShard
from RL2.models.vocab_parallel import VocabShard


@dataclass
class ModelLayout:
    """How one model's forward is split; `FSDPWorker` attaches it to the model as `parallel_layout`.

    Attributes:
        vocab: the vocabulary slice of this rank's logits (tensor parallelism).
        cp_group: the context-parallel group, None without context parallelism.
    """

    vocab: VocabShard = field(default_factory=VocabShard)
    cp_group: dist.ProcessGroup | None = None


@dataclass
class PackedForward:
    """A model's output on one packed row, as this rank holds it.

    Attributes:
        local_logits: `[1, t, V_local]`: this rank's tokens (all T without cp), its vocabulary slice.
        local_labels: `[1, t]` the labels of those tokens.
        vocab: reductions over the (possibly split) vocabulary.
        context: how the row is split over cp ranks, None without context parallelism.
        length: T, the tokens of the whole row.
    """

    local_logits: torch.Tensor
    local_labels: torch.Tensor
    vocab: VocabShard
    context: ContextShard | None
    length: int

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token values of this rank's tokens `[1, t]` -> the whole row `[1, T]`, differentiably."""
        return local if self.context is None else self.context.gather(local, self.length)

    @property
    def logits(self) -> torch.Tensor:
        """Full `[1, T, V]` logits; only when neither the tokens nor the vocabulary are split."""
        if self.context is not None or self.vocab.split:
            raise RuntimeError("logits are split over cp/tp ranks; use PackedForward.logps(), entropy(), values() "
                               "or reduce local_logits with PackedForward.vocab and gather()")
        return self.local_logits

    def logps(self, temperature: float = 1.0) -> torch.Tensor:
        """log p(labels[t] | prefix), float32 `[1, T]`."""
        return self.gather(self.vocab.token_logps(self.local_logits, self.local_labels, temperature))

    def entropy(self) -> torch.Tensor:
        """Entropy of each next-token distribution, float32 `[1, T]`."""
        if self.vocab.split:
            return self.gather(self.vocab.entropy(self.local_logits))
        return self.gather(entropy_from_logits(self.local_logits.float()))

    def values(self) -> torch.Tensor:
        """A scalar head's output at every position (critic, reward model), float32 `[1, T]`."""
        return self.gather(self.local_logits.squeeze(-1).float())


def forward_packed(model: torch.nn.Module, mb: MicroBatch) -> PackedForward:
    """Run the model on one packed row; attention stays within each sequence (see RL2.models.attention)."""
    layout = getattr(model, "parallel_layout", None) or ModelLayout()
    length = mb.input_ids.shape[1]
    if layout.cp_group is None:
        max_len = max(mb.seq_lens)
        out = model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            cu_seq_lens_q=mb.cu_seqlens,
            cu_seq_lens_k=mb.cu_seqlens,
            max_length_q=max_len,
            max_length_k=max_len,
            use_cache=False,
        )
        return PackedForward(out.logits, mb.labels, layout.vocab, None, length)
    shard = ContextShard.build(mb.cu_seqlens, layout.cp_group)
    out = model(
        input_ids=shard.shard(mb.input_ids),
        position_ids=shard.positions.unsqueeze(0),
        context_shard=shard,
        use_cache=False,
    )
    return PackedForward(out.logits, shard.shard(mb.labels), layout.vocab, shard, length)


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels[t] | prefix) in float32, `[1, T]`, from full-vocabulary logits."""
    return VocabShard().token_logps(logits, labels, temperature)


def packed_logps(model: torch.nn.Module, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
    return forward_packed(model, mb).logps(temperature)
