"""The policy: log-probabilities of packed rollouts and the policy update over mini-batches. Every rank holds
the whole rollout and processes its share; per-token results are summed over the data-parallel ranks."""

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from RL2.algs.kl import compute_kl
from RL2.algs.policy_loss import (
    TRAJECTORY_LEVEL_CORRECTIONS,
    Correction,
    cispo_loss,
    engine_kl_by_lag,
    gspo_loss,
    lag_means,
    ppo_loss,
)
from RL2.batch import MicroBatch, RolloutBatch, SequenceBatch
from RL2.models.logps import forward_packed, shares_prefixes
from RL2.models.lora import adapters_disabled
from RL2.packing import pack, prompt_group_units, train_weights
from RL2.parallel import ParallelDims
from RL2.workers.fsdp import FSDPWorker

# actor.policy_loss -> the actor config -> its loss of RL2.algs.policy_loss with that config's bounds (the names,
# and the config keys each reads, are RL2/config/ppo_schema.py's POLICY_LOSS_KEYS).
POLICY_LOSSES: dict[str, Callable] = {
    "ppo": lambda cfg: partial(ppo_loss, clip_low=cfg.clip if cfg.clip_low is None else cfg.clip_low,
                               clip_high=cfg.clip if cfg.clip_high is None else cfg.clip_high, dual_clip=cfg.dual_clip),
    "gspo": lambda cfg: partial(gspo_loss, clip_low=cfg.gspo.clip_low, clip_high=cfg.gspo.clip_high),
    "gspo_token": lambda cfg: partial(gspo_loss, clip_low=cfg.gspo.clip_low, clip_high=cfg.gspo.clip_high,
                                      token_level=True),
    "cispo": lambda cfg: partial(cispo_loss, clip_low=cfg.cispo.clip_low, clip_high=cfg.cispo.clip_high),
}
# One importance ratio per trajectory: all of a trajectory's sequences must be in the same micro-batch.
TRAJECTORY_LEVEL_LOSSES = ("gspo", "gspo_token")
# Metrics that are a micro-batch's smallest or largest value, not a weighted mean (`policy_loss._reduce`).
EXTREMES = ("correction_weight_min", "correction_weight_max")


def engine_correction(cfg) -> Correction | None:
    """The actor config's engine correction: `actor.correction`, or `actor.tis_coef` (its short form)."""
    if cfg.tis_coef is not None:
        return Correction("tis", high=cfg.tis_coef)
    correction = getattr(cfg, "correction", None)  # an OmegaConf node or the schema's dataclass (bench_gpu.py)
    return Correction(correction.type, correction.low, correction.high) if (
        correction and correction.type != "none") else None


def trajectory_units(batch: SequenceBatch, budget: int, loss: str) -> list[list[int]]:
    """Packing units (`pack(units=...)`) that keep each trajectory's sequences together; `budget` is the
    most labels of one micro-batch, `loss` what reads whole trajectories (for the error)."""
    units = [unit for unit in batch.sample_sequences if unit]
    longest = max((sum(batch.label_counts[i] for i in unit) for unit in units), default=0)
    if longest > budget:
        raise ValueError(
            f"actor.policy_loss={loss} computes one ratio over each trajectory, so all its sequences go into one "
            f"micro-batch, but a trajectory has {longest} tokens, more than actor.max_length_per_device x cp_size x "
            f"tp_size = {budget}; raise actor.max_length_per_device (or cp_size), or use actor.policy_loss=ppo")
    return units


def n_mini_batches(n_prompts: int, mini_batch_size: int | None) -> int:
    return -(-n_prompts // mini_batch_size) if mini_batch_size else 1


def pack_for(model: torch.nn.Module, batch: SequenceBatch, dims: ParallelDims, max_tokens: int,
             weights: torch.Tensor | None = None, units: list[list[int]] | None = None,
             budget_key: str = "actor.max_length_per_device") -> list[MicroBatch]:
    """This rank's micro-batches of `batch` (`pack`; `budget_key` names `max_tokens` in errors); where `model`
    stores shared prefixes once, a rollout's prompt groups go whole where they fit (`prompt_group_units`)."""
    sizes = None
    if shares_prefixes(model) and isinstance(batch, RolloutBatch):
        units, sizes = prompt_group_units(batch, dims.dp, max_tokens * dims.seq_parallel)
    return pack(batch, dims.dp_rank, dims.dp, max_tokens, weights, units=units, seq_parallel=dims.seq_parallel,
                unit_sizes=sizes, budget_key=budget_key)


def per_token_pass(worker: FSDPWorker, batch: SequenceBatch, fn: Callable[[MicroBatch], torch.Tensor],
                   budget_key: str = "actor.max_length_per_device") -> torch.Tensor:
    """Run `fn` (micro-batch -> `[1, T]` values of `worker`'s model) on this rank's share; every rank gets every
    label's value, `[n_labels]` float32 on the CPU. `budget_key`: as in `pack_for`."""
    dims, device = worker.dims, worker.device
    values = torch.zeros(batch.n_labels, device=device)
    for mb in pack_for(worker.model, batch, dims, worker.cfg.max_length_per_device, budget_key=budget_key):
        out = fn(mb.to(device)).detach().float()
        for i, chunk in zip(mb.sequence_ids, mb.unpack(out)):
            values[batch.offsets[i] : batch.offsets[i + 1]] = chunk
    # Each sequence was computed by one data-parallel rank and is 0 on the others: the sum is exact.
    dist.all_reduce(values, group=dims.dp_mesh.get_group())
    return values.cpu()


def update_passes(cfg, batch: RolloutBatch, step: Callable[[RolloutBatch], dict], prefix: str) -> dict[str, float]:
    """`cfg.update_per_rollout` passes over a rollout, one `step` per mini-batch of `cfg.mini_batch_size` prompt
    groups; each metric averaged over the steps (a `_min` or `_max` one: the extreme), under `prefix/`."""
    mini_batches = batch.mini_batches(cfg.mini_batch_size)
    steps = [step(mini_batch) for _ in range(cfg.update_per_rollout) for mini_batch in mini_batches]

    def over_steps(values: list[float], name: str) -> float:
        if name.endswith(("_min", "_max")):
            return min(values) if name.endswith("_min") else max(values)
        return sum(values) / len(values)

    return {f"{prefix}/{k}": over_steps([s[k] for s in steps], k) for k in steps[0]}


def extremes_over_ranks(extremes: dict[str, list[float]], names: tuple[str, ...],
                        device: torch.device) -> dict[str, float]:
    """Over ranks, the smallest value of each `_min` metric of `names` and the largest of each `_max` one (0.0
    where no rank had a token). Collective, unless `names` is empty."""
    if not names:
        return {}
    # Negated, a largest value is a smallest one: one MIN reduction covers both.
    sign = {n: 1.0 if n.endswith("_min") else -1.0 for n in names}
    values = torch.tensor([min((sign[n] * v for v in extremes.get(n, [])), default=torch.inf)
                           for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return {n: sign[n] * v if v != torch.inf else 0.0 for n, v in zip(names, values.tolist())}


def weighted_means(summed: dict[str, float]) -> dict[str, float]:
    """Sums over the batch of loss-weighted figures -> their weighted means. Losses stay as they are (the
    objective); other metrics are divided by the total weight, which is 1 except for avg_level=constant."""
    weight = max(summed.pop("weight"), 1e-12)
    return {k: v if k.startswith("loss") else v / weight for k, v in summed.items()}


class BaseModelReference:
    """The reference of a LoRA policy: the policy's own base model with its adapters switched off (the
    initial weights until a ProRL reset moves adapters into it; no second copy, as verl and TRL do)."""

    def __init__(self, actor: "Actor"):
        self.actor, self.worker, self.model = actor, actor.worker, actor.model

    @torch.no_grad()
    def logps(self, batch: SequenceBatch) -> torch.Tensor:
        with adapters_disabled(self.model):
            return self.actor.logps(batch)


class Actor:
    """The policy being trained (`train=False`: a frozen reference or teacher): softmax(logits / temperature), the
    distribution the engines sample and report (as verl, OpenRLHF and the original RL2 divide the logits).
    `response_budget` (the most sampled tokens of one response) is the normaliser of avg_level=constant."""

    def __init__(self, cfg, dims: ParallelDims, device: torch.device, total_steps: int = 0,
                 response_budget: int | None = None, train: bool = True, model_name: str | None = None,
                 base_changes: bool = False, temperature: float = 1.0):
        self.cfg, self.dims, self.device, self.response_budget = cfg, dims, device, response_budget
        self.temperature = temperature
        self.correction = engine_correction(cfg)
        self.worker = FSDPWorker(cfg, dims, device, total_steps, train=train, model_name=model_name,
                                 base_changes=base_changes, section="actor")
        self.model = self.worker.model

    @torch.no_grad()
    def logps(self, batch: SequenceBatch) -> torch.Tensor:
        """`[n_labels]` log p(label | prefix) at `temperature` of every trained label (0.0 at the others)."""
        return per_token_pass(self.worker, batch,
                              lambda mb: forward_packed(self.model, mb, trained_only=True).logps(self.temperature))

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """`update_per_rollout` passes over the rollout, one optimizer step per mini-batch of prompt groups."""
        return lag_means(update_passes(self.cfg, batch, self._step, "actor"), "actor/")

    def _step(self, batch: RolloutBatch) -> dict[str, float]:
        cfg = self.cfg
        weights = train_weights(batch, cfg.avg_level, self.response_budget)
        whole = cfg.policy_loss if cfg.policy_loss in TRAJECTORY_LEVEL_LOSSES else (
            f"{cfg.policy_loss} with actor.correction.type={self.correction.name}" if self.correction is not None and
            self.correction.name in TRAJECTORY_LEVEL_CORRECTIONS else None)  # what reads whole trajectories
        units = trajectory_units(batch, cfg.max_length_per_device * self.dims.seq_parallel, whole) if whole else None
        # Each token's trajectory travels with it into the micro-batches (a trajectory-level loss reads it).
        batch = replace(batch, tokens=batch.tokens | {"sample_of_label": batch.sample_of_label})
        micro = pack_for(self.model, batch, self.dims, cfg.max_length_per_device, weights, units)
        extremes: dict[str, list[float]] = {}

        def loss_fn(mb: MicroBatch):  # a micro-batch's smallest and largest values are kept apart, not summed
            loss, metrics = self._micro_batch_loss(mb)
            for name in EXTREMES:
                if name in metrics:
                    extremes.setdefault(name, []).append(float(metrics.pop(name)))
            return loss, metrics

        totals = self.worker.run_micro_batches(micro, loss_fn)
        stats = self.worker.optimizer_step()
        names = EXTREMES if self.correction is not None else ()
        return weighted_means(totals) | extremes_over_ranks(extremes, names, self.device) | stats  # grad_norm, lr

    def _micro_batch_loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch, already weighted for the global batch, and metric partial sums."""
        cfg = self.cfg
        weights = mb.loss_weights  # sum to 1 over the (mini-)batch on all ranks
        output = forward_packed(self.model, mb, trained_only=True)
        logps, entropy = output.logps_and_entropy(entropy_grad=cfg.entropy.coef > 0, last_use=True,
                                                  temperature=self.temperature)
        old_logps = mb.extras.get("old_logps", logps.detach())
        engine_logps = mb.extra("engine_logps")
        losses, metrics = POLICY_LOSSES[cfg.policy_loss](cfg)(
            logps, old_logps, mb.extra("advantages"), weights, sample_ids=mb.extra("sample_of_label").long(),
            engine_logps=engine_logps, correction=self.correction)
        # Means over this micro-batch times its weight sum add up over micro-batches and ranks (`weighted_means`).
        metrics = {k: v if k in EXTREMES else v * weights.sum() for k, v in metrics.items()}
        if "lags" in mb.extras:
            metrics |= engine_kl_by_lag(old_logps, engine_logps, mb.extra("lags"), weights)
        metrics["loss_pg"] = (losses * weights).sum().detach()
        metrics["engine_mismatch"] = ((old_logps - engine_logps).abs() * weights).sum()
        if cfg.kl.coef > 0 and cfg.kl.type == "loss":
            kl = compute_kl(cfg.kl.estimator, logps, mb.extra("ref_logps"))
            losses = losses + cfg.kl.coef * kl
            metrics["kl"] = (kl.detach() * weights).sum()
        if cfg.entropy.coef > 0:
            losses = losses - cfg.entropy.coef * entropy
        metrics["entropy"] = (entropy.detach() * weights).sum()
        loss = (losses * weights).sum()
        metrics["loss"] = loss.detach()
        metrics["weight"] = weights.sum()
        return loss, metrics
