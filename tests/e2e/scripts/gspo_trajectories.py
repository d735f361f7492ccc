"""One GSPO update on hand-made trajectories of one to three sequences, against the model's own forward.

    python tests/e2e/scripts/gspo_trajectories.py OUT.pt key=value ...   (or under torchrun)

The actor's gradient (captured before the optimizer step) and loss are saved next to the same
quantities computed independently: the HF model run on each sequence alone, one ratio per
trajectory over all its sampled tokens, the paper's objective averaged over trajectories.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from RL2.batch import RolloutBatch
from RL2.config.cli import parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.parallel import ParallelDims, close_process_groups, init_distributed, pick_device
from RL2.workers.actor import Actor

N_TRAJECTORIES = 8


def trajectories(vocab: int) -> RolloutBatch:
    """Trajectories of 1-3 sequences (prompt of 3-5 tokens, 1-3 sampled), the same on every rank."""
    generator = torch.Generator().manual_seed(0)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=generator))

    input_ids, masks, sample_ids = [], [], []
    for sample in range(N_TRAJECTORIES):
        for _ in range(randint(1, 4)):
            prompt = torch.randint(0, vocab, (randint(3, 6),), generator=generator).tolist()
            response = torch.randint(0, vocab, (randint(1, 4),), generator=generator).tolist()
            input_ids.append(prompt + response)
            masks.append(torch.tensor([0.0] * (len(prompt) - 1) + [1.0] * len(response)))
            sample_ids.append(sample)
    loss_mask = torch.cat(masks)
    sample_ids = torch.tensor(sample_ids)
    lengths = torch.zeros(N_TRAJECTORIES).index_add_(0, sample_ids, torch.stack([m.sum() for m in masks]))
    return RolloutBatch(
        input_ids=input_ids, sample_ids=sample_ids,
        tokens={"loss_mask": loss_mask, "turn_ids": torch.where(loss_mask > 0, 0, -1)},
        group_ids=torch.arange(N_TRAJECTORIES) // 2, rewards=torch.zeros(N_TRAJECTORIES),
        turn_rewards=torch.zeros(N_TRAJECTORIES, 1), turn_mask=torch.ones(N_TRAJECTORIES, 1),
        response_lengths=lengths,
    )


def independent_gspo(model_path: str, batch: RolloutBatch, clip_low: float, clip_high: float,
                     token_level: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """The objective (1/n) sum_i -min(s_i A_i, clip(s_i) A_i) and its gradient, one sequence at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    log_ratios = [[] for _ in range(batch.n_samples)]
    advantages = torch.zeros(batch.n_samples)
    for i, ids in enumerate(batch.input_ids):
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        logps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        sampled = batch.sequence("loss_mask", i) > 0
        sample = int(batch.sample_ids[i])
        log_ratios[sample].append((logps - batch.sequence("old_logps", i))[sampled])
        advantages[sample] = batch.sequence("advantages", i)[sampled][0]
    loss = 0.0
    for log_ratio, advantage in zip(log_ratios, advantages):
        log_ratio = torch.cat(log_ratio)
        if token_level:  # GSPO-token, token by token with the trajectory's ratio as a constant
            ratio = torch.exp(log_ratio - log_ratio.detach() + log_ratio.mean().detach())
        else:
            ratio = torch.exp(log_ratio.mean()).expand_as(log_ratio)
        per_token = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - clip_low, 1 + clip_high))
        loss = loss + per_token.mean() / batch.n_samples
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    cfg = parse_config(PPOConfig, "ppo", argv)
    device = pick_device("cpu")
    init_distributed(device)
    dims = ParallelDims.from_config(cfg.actor, device)
    dims.build_mesh()
    actor = Actor(cfg.actor, dims, device, total_steps=10, response_budget=8)
    batch = trajectories(1000)
    mask = batch.tokens["loss_mask"]
    noise = torch.randn(batch.n_labels, generator=torch.Generator().manual_seed(1))
    # Old log-probs a little off the current ones, so that the trajectories' ratios straddle the clip range.
    batch.tokens["old_logps"] = (actor.logps(batch) + 0.03 * noise) * mask
    batch.tokens["engine_logps"] = batch.tokens["old_logps"]
    signs = torch.tensor([1.0, -1.0]).repeat(N_TRAJECTORIES // 2)
    batch.tokens["advantages"] = signs[batch.sample_of_label] * mask

    captured = {}
    step = actor.worker.optimizer_step

    def capture_then_step():
        for name, param in actor.model.named_parameters():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            captured[name] = grad.detach().clone()
        return step()

    actor.worker.optimizer_step = capture_then_step
    metrics = actor.update(batch)
    if dist.get_rank() == 0:
        gspo = cfg.actor.gspo
        loss, grads = independent_gspo(cfg.actor.model_name, batch, gspo.clip_low, gspo.clip_high,
                                       cfg.actor.policy_loss == "gspo_token")
        torch.save({"metrics": metrics, "grads": captured, "expected_loss": loss, "expected_grads": grads,
                    "sequences_per_trajectory": torch.bincount(batch.sample_ids).tolist()}, out)
    close_process_groups()


if __name__ == "__main__":
    main()
