"""After one DPO (or ORPO) step, compare the trainer's packed loss with the formula evaluated on plain,
unpacked forward passes of the same weights (reference = the initial checkpoint)."""

import json
import math
import sys

import torch
from transformers import AutoModelForCausalLM

from RL2.config import parse_config
from RL2.config.schema import DPOConfig, ORPOConfig
from RL2.trainer.dpo import DPOTrainer
from RL2.trainer.orpo import ORPOTrainer

kind, argv = sys.argv[1], sys.argv[2:]
schema, trainer_cls = {"dpo": (DPOConfig, DPOTrainer), "orpo": (ORPOConfig, ORPOTrainer)}[kind]
cfg = parse_config(schema, kind, argv)
trainer = trainer_cls(cfg)
trainer.train_step(1)
pairs = trainer.train_data[:5]
packed = trainer.pairs_pass(pairs, train=False)

trained = AutoModelForCausalLM.from_pretrained(cfg.actor.model_name, attn_implementation="eager", dtype=torch.float64)
trained.load_state_dict({k: v.double() for k, v in trainer.worker.full_state_dict().items()}, strict=False)
initial = AutoModelForCausalLM.from_pretrained(cfg.actor.model_name, attn_implementation="eager", dtype=torch.float64)


def response_logp(model, example) -> tuple[float, int]:
    """Sum of log p over the response tokens, one sequence alone, no packing."""
    ids = torch.tensor([example["input_ids"]])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
    total, count = 0.0, 0
    for t, (token, trained_on) in enumerate(zip(example["input_ids"][1:], example["loss_mask"][1:])):
        if trained_on:
            total += logprobs[t, token].item()
            count += 1
    return total, count


beta, losses = cfg.actor.beta, []
for pair in pairs:
    (lc, nc), (lr, nr) = response_logp(trained, pair["chosen"]), response_logp(trained, pair["rejected"])
    if kind == "dpo":
        (rc, _), (rr, _) = response_logp(initial, pair["chosen"]), response_logp(initial, pair["rejected"])
        h = (lc - rc) - (lr - rr)
        losses.append(-math.log(1 / (1 + math.exp(-beta * h))))
    else:
        ac, ar = lc / nc, lr / nr
        log_odds = (ac - math.log(1 - math.exp(ac))) - (ar - math.log(1 - math.exp(ar)))
        losses.append(-ac - beta * math.log(1 / (1 + math.exp(-log_odds))))
print(json.dumps({"packed": packed["loss"], "direct": sum(losses) / len(losses)}))
