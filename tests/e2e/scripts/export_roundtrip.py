"""Train briefly, export, reload with plain transformers, and compare logits with the trained model."""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from RL2.batch import SequenceBatch
from RL2.config import parse_config
from RL2.config.schema import SFTConfig
from RL2.models.logps import forward_packed
from RL2.packing import pack
from RL2.trainer.sft import SFTTrainer

cfg = parse_config(SFTConfig, "sft", sys.argv[1:])
trainer = SFTTrainer(cfg)
trainer.train()
folder = f"{cfg.trainer.save_dir}/final/actor"
reloaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
initial = AutoModelForCausalLM.from_pretrained(cfg.actor.model_name, attn_implementation="eager")
(mb,) = pack(SequenceBatch.from_examples(trainer.train_data[:4]), 0, 1, max_tokens=10_000)
with torch.no_grad():  # the trained model on the trainer's device (CPU or CUDA), the reloaded ones on the CPU
    trained_logits = forward_packed(trainer.actor.model, mb.to(trainer.device)).logits.cpu()
    diffs, changed = [], 0
    for seq_logits, example_id in zip(mb.unpack(trained_logits), mb.sequence_ids):
        ids = torch.tensor([trainer.train_data[example_id]["input_ids"][:-1]])
        diffs.append((reloaded(input_ids=ids).logits[0] - seq_logits).abs().max().item())
        changed += int(not torch.allclose(initial(input_ids=ids).logits[0], seq_logits, atol=1e-3))
print(json.dumps({"max_logit_diff": max(diffs), "changed": changed}))
