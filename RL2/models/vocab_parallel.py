"""Softmax statistics over a vocabulary split across tensor-parallel ranks, as Megatron-LM's vocab-parallel
cross-entropy: each rank reduces its `[..., V / tp]` slice and one all-reduce of a `[...]` tensor combines them. Every
tp rank computes the same loss from the same values, so the all-reduce's backward is the identity (`_SumOverRanks`)."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from RL2.models import chunked_logps


class _SumOverRanks(torch.autograd.Function):
    """All-reduce sum forward; identity backward (the result feeds a loss every rank computes alike)."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReplicatedToLocal(torch.autograd.Function):
    """Identity forward; all-reduce sum backward (Megatron's "f" operator): for a replicated value (the
    log-sum-exp) inside each rank's partial sum, whose gradient is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass
class VocabShard:
    """The vocabulary slice of this rank's logits, from token id `offset`; `group`: the tp group, None: all of it."""

    group: dist.ProcessGroup | None = None
    offset: int = 0

    @property
    def split(self) -> bool:
        return self.group is not None

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum over the last (vocabulary) dimension, over the whole vocabulary."""
        total = values.sum(-1)
        return _SumOverRanks.apply(total, self.group) if self.split else total

    def logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return torch.logsumexp(logits, -1)
        # The max only keeps exp() in range; it cancels out of the result, so it needs no gradient.
        peak = logits.detach().max(-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        return peak + self.sum((logits - peak.unsqueeze(-1)).exp()).log()

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """This slice of the log-softmax over the whole vocabulary."""
        if not self.split:
            return F.log_softmax(logits, -1)
        return logits - self._to_local(self.logsumexp(logits)).unsqueeze(-1)

    def pick(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`logits[..., labels]`, read on the rank whose slice holds each label."""
        local = labels - self.offset
        inside = (local >= 0) & (local < logits.shape[-1])
        picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * inside
        return _SumOverRanks.apply(picked, self.group) if self.split else picked

    def token_logps(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                    overwrite_logits: bool = False) -> torch.Tensor:
        """log p(labels) in float32. `overwrite_logits` (unsplit logits only): see `chunked_logps.LogpsAndEntropy`."""
        if not self.split:  # a few tokens at a time: no [T, V] float32 copy (RL2.models.chunked_logps)
            return chunked_logps.token_logps(logits, labels, temperature, overwrite_logits)
        logits = chunked_logps.scaled(logits, temperature)
        return self.pick(logits, labels) - self.logsumexp(logits)

    def entropy(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Entropy of softmax(logits / temperature), `lse - sum_v p_v z_v` of the scaled logits z, in float32."""
        logits = chunked_logps.scaled(logits, temperature)
        lse = self.logsumexp(logits)
        probs = (logits - self._to_local(lse).unsqueeze(-1)).exp()
        return lse - self.sum(probs * logits)

    def _to_local(self, replicated: torch.Tensor) -> torch.Tensor:
        return _ReplicatedToLocal.apply(replicated, self.group) if self.split else replicated
