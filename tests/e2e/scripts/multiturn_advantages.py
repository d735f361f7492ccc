"""One PPO step on an environment whose every turn starts a new sequence; prints, per trajectory, its
turn rewards and the advantages (and returns) the trainer gave each of its sequences' sampled tokens.

    python tests/e2e/scripts/multiturn_advantages.py key=value ...   (or under torchrun)
"""

import json
import sys

import torch.distributed as dist

from RL2.config import parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.parallel import close_process_groups
from RL2.rollout.trajectory import training_batch
from RL2.trainer.ppo import PPOTrainer

cfg = parse_config(PPOConfig, "ppo", sys.argv[1:])
trainer = PPOTrainer(cfg)
groups, _ = trainer.collect_groups(1, {})
batch = training_batch(groups)
trainer.learn(batch)


def sampled(name: str, sequence: int) -> list[float]:
    return batch.sequence(name, sequence)[batch.sequence("loss_mask", sequence) > 0].tolist()


report, sample = [], 0
for group in groups:
    report.append([])
    for trajectory in group:
        sequences = (batch.sample_ids == sample).nonzero()[:, 0].tolist()
        report[-1].append({
            "turn_rewards": [turn.reward for turn in trajectory.turns],
            "advantages": [sampled("advantages", i) for i in sequences],
            "returns": [sampled("returns", i) for i in sequences] if "returns" in batch.tokens else None,
        })
        sample += 1
if dist.get_rank() == 0:
    print(json.dumps(report))
close_process_groups()
