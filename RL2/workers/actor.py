"""The policy: log-probabilities of packed rollouts and the clipped policy update over mini-batches.

Examples are the dicts of `Trajectory.to_examples()`: per-token lists as long as `input_ids`
(index t is about token t, index 0 is unused) plus per-trajectory numbers. Every rank holds the
whole rollout; each packs and processes its own share (`pack_examples`), and per-token results are
all-gathered over the data-parallel ranks so that every rank can compute advantages on the whole
batch, with the pure functions of `RL2.algs`.
"""

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist

from RL2.algs.kl import compute_kl
from RL2.algs.policy_loss import policy_loss
from RL2.datasets.packing import MicroBatch, pack_examples
from RL2.models.logps import forward_packed
from RL2.parallel import ParallelDims
from RL2.workers.fsdp import FSDPWorker


def extra(mb: MicroBatch, key: str) -> torch.Tensor:
    """A per-token extra of a micro-batch; zeros for the padding micro-batch (which has none)."""
    return mb.extras.get(key, torch.zeros_like(mb.loss_mask))


def mini_batches(examples: list[dict], n_prompts: int, mini_batch_size: int | None) -> list[list[dict]]:
    """Split a rollout into mini-batches of whole prompt groups (`example["group"]`), in order."""
    if not mini_batch_size or mini_batch_size >= n_prompts:
        return [examples]
    batches = defaultdict(list)
    for example in examples:
        batches[example["group"] // mini_batch_size].append(example)
    return [batches[k] for k in sorted(batches)]


def n_mini_batches(n_prompts: int, mini_batch_size: int | None) -> int:
    return -(-n_prompts // mini_batch_size) if mini_batch_size else 1


def per_token_pass(
    dims: ParallelDims, examples: list[dict], max_tokens: int, device: torch.device,
    fn: Callable[[MicroBatch], torch.Tensor],
) -> list[list[float]]:
    """Run `fn` (micro-batch -> `[1, T]` values) on this rank's share; every rank gets every example's list.

    Returns:
        One list per example, as long as its `input_ids`, with 0.0 at index 0.
    """
    local = {}
    for mb in pack_examples(examples, dims.dp_rank, dims.dp, max_tokens, seq_parallel=dims.seq_parallel):
        values = fn(mb.to(device)).detach().float().cpu()
        for index, chunk in zip(mb.example_ids, mb.unpack(values)):
            local[index] = [0.0] + chunk.tolist()
    gathered = [None] * dims.dp
    dist.all_gather_object(gathered, local, group=dims.dp_mesh.get_group())
    merged = {k: v for part in gathered for k, v in part.items()}
    return [merged[i] for i in range(len(examples))]


def weighted_means(totals: dict[str, float], dims: ParallelDims, device: torch.device) -> dict[str, float]:
    """Sums over micro-batches and ranks of loss-weighted figures -> their weighted means over the batch.

    Losses stay as they are (the objective); other metrics are divided by the total weight, which is
    1 except for avg_level=constant.
    """
    summed = torch.tensor(list(totals.values()), dtype=torch.float64, device=device)
    dist.all_reduce(summed, group=dims.dp_mesh.get_group())  # cp and tp ranks of a dp group hold the same sums
    summed = dict(zip(totals, summed.tolist()))
    weight = max(summed.pop("weight"), 1e-12)
    return {k: v if k.startswith("loss") else v / weight for k, v in summed.items()}


class Actor:
    """The policy being trained (or, with `train=False`, the frozen reference).

    Args:
        cfg: the `actor` config.
        dims, device: the parallel layout and where computation runs.
        total_steps: optimizer steps of the run (for the learning-rate schedule).
        constant: normaliser of avg_level=constant (the generation budget).
        train: False for the reference: no optimizer.
        model_name: other weights than `cfg.model_name` (the on-policy distillation teacher).
    """

    def __init__(self, cfg, dims: ParallelDims, device: torch.device, total_steps: int = 0,
                 constant: int | None = None, train: bool = True, model_name: str | None = None):
        self.cfg, self.dims, self.device, self.constant = cfg, dims, device, constant
        self.worker = FSDPWorker(cfg, dims, device, total_steps, train=train, model_name=model_name)
        self.model = self.worker.model

    @torch.no_grad()
    def logps(self, examples: list[dict]) -> list[list[float]]:
        """log p(token t | tokens < t) of every trained token of every example (0.0 at the others)."""
        return per_token_pass(self.dims, examples, self.cfg.max_length_per_device, self.device,
                              lambda mb: forward_packed(self.model, mb, trained_only=True).logps())

    def update(self, examples: list[dict], n_prompts: int) -> dict[str, float]:
        """`update_per_rollout` passes over the rollout, one optimizer step per mini-batch.

        Needs `advantages` and `engine_logps` per token, `old_logps` unless a single step covers the
        rollout (then the policy has not moved yet and old = current), and `ref_logps` with a KL loss.
        """
        steps = []
        for _ in range(self.cfg.update_per_rollout):
            for batch in mini_batches(examples, n_prompts, self.cfg.mini_batch_size):
                steps.append(self._step(batch))
        return {f"actor/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]}

    def _step(self, batch: list[dict]) -> dict[str, float]:
        totals = defaultdict(float)
        micro = pack_examples(batch, self.dims.dp_rank, self.dims.dp, self.cfg.max_length_per_device,
                              self.cfg.avg_level, constant=self.constant, seq_parallel=self.dims.seq_parallel)
        for mb in micro:
            mb = mb.to(self.device)
            loss, metrics = self._micro_batch_loss(mb)
            self.worker.backward(loss * self.dims.grad_divide_factor)
            for key, value in metrics.items():
                totals[key] += float(value)
            totals["weight"] += mb.loss_weights.sum().item()
        stats = self.worker.optimizer_step()
        return weighted_means(totals, self.dims, self.device) | {"grad_norm": stats["grad_norm"], "lr": stats["lr"]}

    def _micro_batch_loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch, already weighted for the global batch, and metric partial sums."""
        cfg = self.cfg
        weights = mb.loss_weights  # sum to 1 over the (mini-)batch on all ranks
        output = forward_packed(self.model, mb, trained_only=True)
        logps, entropy = output.logps_and_entropy(entropy_grad=cfg.entropy.coef > 0)
        old_logps = mb.extras.get("old_logps", logps.detach())
        engine_logps = extra(mb, "engine_logps")
        losses, metrics = policy_loss(
            logps, old_logps, extra(mb, "advantages"), weights,
            clip_low=cfg.clip if cfg.clip_low is None else cfg.clip_low,
            clip_high=cfg.clip if cfg.clip_high is None else cfg.clip_high,
            dual_clip=cfg.dual_clip, engine_logps=engine_logps, tis_coef=cfg.tis_coef,
        )
        # policy_loss gives means over this micro-batch under `weights`; times the weight sum they add up
        # over micro-batches and ranks (see `weighted_means`).
        metrics = {k: v * weights.sum() for k, v in metrics.items()}
        metrics["loss_pg"] = (losses * weights).sum().detach()
        metrics["engine_mismatch"] = ((old_logps - engine_logps).abs() * weights).sum()
        if cfg.kl.coef > 0 and cfg.kl.type == "loss":
            kl = compute_kl(cfg.kl.estimator, logps, extra(mb, "ref_logps"))
            losses = losses + cfg.kl.coef * kl
            metrics["kl"] = (kl.detach() * weights).sum()
        if cfg.entropy.coef > 0:
            losses = losses - cfg.entropy.coef * entropy
        metrics["entropy"] = (entropy.detach() * weights).sum()
        loss = (losses * weights).sum()
        metrics["loss"] = loss.detach()
        return loss, metrics
