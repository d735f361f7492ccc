"""Forward a packed micro-batch and read off per-token log-probabilities, entropies or values. `PackedForward`
hides tensor parallelism (each rank holds a vocabulary slice of the logits, reduced with `RL2.models.vocab_parallel`)
and context parallelism (a share of the tokens, gathered over the cp ranks): callers get whole `[1, T]` rows."""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from RL2.batch import MicroBatch
from RL2.models import chunked_logps
from RL2.models.context_parallel import ContextShard
from RL2.models.shared_prefix import SharedPrefixRow
from RL2.models.vocab_parallel import VocabShard


@dataclass
class ModelLayout:
    """How one model's forward is split; `FSDPWorker` attaches it to the model as `parallel_layout`."""

    vocab: VocabShard = field(default_factory=VocabShard)  # the vocabulary slice of this rank's logits (tp)
    cp_group: dist.ProcessGroup | None = None  # None without context parallelism
    share_prefixes: bool = False  # compute a prefix that consecutive packed sequences share once
    sliding_window: int | None = None  # the model's attention window, not applied: longer sequences are refused


def shares_prefixes(model: torch.nn.Module) -> bool:
    """Whether `forward_packed` stores the prefixes that consecutive sequences share once for this model."""
    layout = getattr(model, "parallel_layout", None)
    return layout is not None and layout.share_prefixes


@dataclass
class PackedForward:
    """A model's output on one packed row, as this rank holds it."""

    local_logits: torch.Tensor  # `[1, k, V_local]`: this rank's t tokens (T without cp) or their `kept` ones
    local_labels: torch.Tensor  # `[1, k]`
    vocab: VocabShard
    context: ContextShard | None  # how the row is split over cp ranks
    length: int  # T, the tokens of the whole row
    kept: torch.Tensor | None = None  # which of the t tokens have logits (`trained_only`), None: all
    local_length: int = 0  # t
    shared: SharedPrefixRow | None = None  # the row the model ran on with shared prefixes stored once
    trained: torch.Tensor | None = None  # with `shared` and `kept`, the row's `loss_mask`: results are 0.0 elsewhere

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token values `[1, k]` of the tokens with logits -> the row `[1, T]` (0.0 elsewhere), differentiably."""
        if self.kept is not None:
            local = local.new_zeros(1, self.local_length).index_copy(1, self.kept, local)
        if self.shared is not None:
            local = self.shared.expand(local)
            if self.trained is not None:
                local = torch.where(self.trained > 0, local, 0.0)
        return local if self.context is None else self.context.gather(local, self.length)

    @property
    def logits(self) -> torch.Tensor:
        """Full `[1, T, V]` logits; only when neither the tokens nor the vocabulary are split."""
        if self.context is not None or self.vocab.split or self.kept is not None:
            raise RuntimeError("logits are split over cp/tp ranks or kept at trained tokens only; use "
                               "PackedForward.logps(), entropy(), values() or reduce local_logits with "
                               "PackedForward.vocab and gather()")
        logits = self._logits(False)
        return logits if self.shared is None else self.shared.expand(logits)

    def logps(self, temperature: float = 1.0, last_use: bool = False) -> torch.Tensor:
        """log p(labels[t] | prefix), float32 `[1, T]`. `last_use`: nothing reads these logits after this
        call, so backward writes their gradient over them (`chunked_logps.LogpsAndEntropy`)."""
        return self.gather(self.vocab.token_logps(self._logits(last_use), self.local_labels, temperature,
                                                  overwrite_logits=last_use))

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        """Entropy of each next-token distribution softmax(logits / temperature), float32 `[1, T]`."""
        entropy = self.vocab.entropy if self.vocab.split else chunked_logps.entropy
        return self.gather(entropy(self._logits(False), temperature))

    def logps_and_entropy(self, entropy_grad: bool = False, last_use: bool = False, temperature: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """`logps()` and `entropy()` in one pass over the logits (`RL2.models.chunked_logps` without tensor
        parallelism); the entropy has a gradient only with `entropy_grad` (an entropy bonus). `last_use`: see logps."""
        if self.vocab.split:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = self.entropy(temperature)
            return self.logps(temperature, last_use=last_use), entropy
        logps, entropy = chunked_logps.logps_and_entropy(self._logits(last_use), self.local_labels,
                                                         overwrite_logits=last_use, temperature=temperature)
        return self.gather(logps), self.gather(entropy if entropy_grad else entropy.detach())

    def _logits(self, last_use: bool) -> torch.Tensor:
        logits = self.local_logits
        if logits is None:
            raise RuntimeError("these logits were handed over with last_use=True, and their memory holds "
                               "their gradient after backward; read everything else from them before that call")
        if last_use:
            self.local_logits = None
        return logits

    def values(self) -> torch.Tensor:
        """A scalar head's output at every position (critic, reward model), float32 `[1, T]`."""
        return self.gather(self._logits(False).squeeze(-1).float())


def forward_packed(model: torch.nn.Module, mb: MicroBatch, trained_only: bool = False) -> PackedForward:
    """Run the model on one packed row, attending within each sequence. `trained_only`: the output projection (much of
    a small model's work) runs only where `mb.loss_mask` trains the label; per-token results read 0.0 elsewhere."""
    layout = getattr(model, "parallel_layout", None) or ModelLayout()
    if layout.sliding_window is not None and max(mb.seq_lens) > layout.sliding_window:
        raise NotImplementedError(
            f"a sequence of {max(mb.seq_lens)} tokens is longer than the model's attention window "
            f"(sliding_window={layout.sliding_window}), which RL2's packed attention does not apply: its "
            f"log-probabilities would not be the model's; keep data.*.max_length and the responses within "
            f"the window, or use a model without one")
    # The row the model runs on: this rank's share (cp), the row with shared prefixes stored once, or the packed row.
    shard = shared = None
    if layout.cp_group is not None:
        shard = ContextShard.build(mb.cu_seqlens, layout.cp_group)
        input_ids, labels, mask = (shard.shard(x) for x in (mb.input_ids, mb.labels, mb.loss_mask))
        positions, kwargs = shard.positions.unsqueeze(0), dict(context_shard=shard)
    elif layout.share_prefixes and (shared := SharedPrefixRow.build(mb)) is not None:
        input_ids, positions, labels = shared.input_ids, shared.position_ids, shared.labels
        mask, kwargs = shared.compress_mask(mb.loss_mask), dict(shared_prefixes=shared)
    else:
        input_ids, positions, labels, mask = mb.input_ids, mb.position_ids, mb.labels, mb.loss_mask
        max_len = max(mb.seq_lens)
        kwargs = dict(cu_seq_lens_q=mb.cu_seqlens, cu_seq_lens_k=mb.cu_seqlens, max_length_q=max_len,
                      max_length_k=max_len)
    kept = mask[0].nonzero()[:, 0] if trained_only else None
    if kept is not None:  # HF's `logits_to_keep` as positions: the output projection runs on those only
        kwargs["logits_to_keep"], labels = kept, labels[:, kept]
    out = model(input_ids=input_ids, position_ids=positions, use_cache=False, **kwargs)
    return PackedForward(out.logits, labels, layout.vocab, shard, mb.input_ids.shape[1], kept, input_ids.shape[1],
                         shared, mb.loss_mask if shared is not None and trained_only else None)


def packed_logps(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """log p of the trained labels of one packed row, `[1, T]` (0.0 where `loss_mask` is 0)."""
    return forward_packed(model, mb, trained_only=True).logps(last_use=True)
