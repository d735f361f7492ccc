"""One PPO step with a reward model and an on-policy distillation teacher; the reward model's scores
of hand-made sequences are compared with a plain transformers forward of each sequence alone."""

import json
import sys

import torch
from transformers import AutoModelForTokenClassification

from RL2.batch import SequenceBatch
from RL2.config import parse_config
from RL2.config.ppo_schema import PPOConfig
from RL2.trainer.ppo import PPOTrainer

cfg = parse_config(PPOConfig, "ppo", sys.argv[1:])
trainer = PPOTrainer(cfg)
metrics = trainer.train_step(1)

examples = [{"input_ids": list(range(5 + 3 * i, 30 + 7 * i)), "loss_mask": [0] * 5 + [1] * (20 + 4 * i)}
            for i in range(3)]
packed = trainer.reward_model.scores(SequenceBatch.from_examples(examples)).tolist()
plain = AutoModelForTokenClassification.from_pretrained(cfg.rollout.reward_model, attn_implementation="eager")
with torch.no_grad():
    direct = [plain(input_ids=torch.tensor([ex["input_ids"][:-1]])).logits[0, -1, 0].item() for ex in examples]
print(json.dumps({"packed": packed, "direct": direct, "metrics": sorted(metrics)}))
