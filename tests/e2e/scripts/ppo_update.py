"""One actor (and critic) update on a fixed, hand-made rollout; prints the metrics, saves the weights.

    python tests/e2e/scripts/ppo_update.py OUT.pt key=value ...   (or under torchrun)

Run on 1 and 2 ranks, and with and without shared prefixes, the losses, metrics and weights must agree:
the update averages over the global batch whatever the split across ranks and micro-batches, and
storing a group's prompt once changes no token's result.
"""

import json
import sys

import torch
import torch.distributed as dist

from RL2.batch import RolloutBatch
from RL2.config.cli import parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.models.logps import shares_prefixes
from RL2.models.shared_prefix import SharedPrefixRow
from RL2.parallel import ParallelDims, close_process_groups, init_distributed, pick_device
from RL2.trainer.ppo_advantages import add_advantages
from RL2.workers.actor import Actor, pack_for
from RL2.workers.critic import Critic

N_PROMPTS, RESPONSES = 6, 2


def fixed_rollout(vocab: int) -> RolloutBatch:
    """Prompts and responses of varied lengths, the same on every rank; rewards 0/1 per response.

    Prompts start alike (as a chat template's system prompt does) and are long enough for a group to
    store its prompt once (`actor.share_prefixes`); the first group's two responses are the same.
    """
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (10,), generator=generator).tolist()
    examples, rewards = [], []
    for group in range(N_PROMPTS):
        n = int(torch.randint(8, 14, (1,), generator=generator))
        prompt = start + torch.randint(0, vocab, (n,), generator=generator).tolist()
        for k in range(RESPONSES):
            n = int(torch.randint(1, 7, (1,), generator=generator))
            response = torch.randint(0, vocab, (n,), generator=generator).tolist()
            if group == 0 and k == 1:
                response = examples[-1]["input_ids"][len(prompt):]
            examples.append({"input_ids": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response)})
            rewards.append(float(torch.rand(1, generator=generator) < 0.5))
    return RolloutBatch.single_turn(examples, [g for g in range(N_PROMPTS) for _ in range(RESPONSES)], rewards)


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    cfg = parse_config(PPOConfig, "ppo", argv)
    device = pick_device("cuda" if cfg.trainer.device == "cuda" else "cpu")  # CPU (gloo) unless asked for cuda
    init_distributed(device)
    torch.manual_seed(0)
    dims = ParallelDims.from_config(cfg.actor, device)
    dims.build_mesh()
    temperature = cfg.rollout.train_sampling_params.temperature  # of the policy, as the PPO trainer passes it
    actor = Actor(cfg.actor, dims, device, total_steps=10, response_budget=8, temperature=temperature)
    ref = Actor(cfg.actor, dims, device, train=False, temperature=temperature)
    critic = Critic(cfg.critic, dims, device, total_steps=10, response_budget=8) if cfg.adv.estimator == "gae" else None
    batch = fixed_rollout(1000)
    if critic:
        batch.tokens["values"] = critic.values(batch)
    batch.tokens["old_logps"] = actor.logps(batch)
    batch.tokens["ref_logps"] = ref.logps(batch)
    # The engine's log-probs differ a little from the trainer's (bf16, other kernels): perturb them.
    noise = torch.randn(batch.n_labels, generator=torch.Generator().manual_seed(1))
    batch.tokens["engine_logps"] = (batch.tokens["old_logps"] + 0.05 * noise) * batch.tokens["loss_mask"]
    metrics = add_advantages(batch, cfg.adv, cfg.actor.kl)
    metrics |= actor.update(batch)
    state = {"actor": actor.worker.full_state_dict()}
    if critic:
        metrics |= critic.update(batch)
        state["critic"] = critic.worker.full_state_dict()
    # Tokens that storing shared prefixes once took out of this rank's micro-batches of the update.
    saved = 0
    for mb in (pack_for(actor.model, batch, dims, cfg.actor.max_length_per_device)
               if shares_prefixes(actor.model) else []):
        row = SharedPrefixRow.build(mb)
        saved += mb.input_ids.shape[1] - row.length if row is not None else 0
    if dist.get_rank() == 0:
        torch.save(state, out)
        print(json.dumps({"metrics": metrics, "tokens_saved": saved}))
    close_process_groups()


if __name__ == "__main__":
    main()
