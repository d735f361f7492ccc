"""Independent computations of what a model does: its greedy tokens and its log-probabilities, from full
forwards of the model itself (no cache, no engine), against which the engines and recorders are checked."""

import torch


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """The `n` tokens greedy decoding writes after `ids`, one full forward per token."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@torch.no_grad()
def token_logps(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 (0.0 at t = 0), from one full forward."""
    logps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [0.0] + logps[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
