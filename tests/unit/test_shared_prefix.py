"""Shared prefixes stored once: the same log-probabilities, entropies and gradients as each sequence alone."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from RL2.batch import SequenceBatch
from RL2.models.logps import ModelLayout, forward_packed
from RL2.models.shared_prefix import SharedPrefixRow
from RL2.packing import pack
from RL2.utils.shared_prefixes import MIN_SHARED_TOKENS, runs_with_shared_prefix

PROMPT = 24  # > MIN_SHARED_TOKENS


def group_examples(seed: int) -> list[dict]:
    """Two prompts with their responses, then a sequence that shares only a short start with them.

    The first group has: two responses that start alike, an exact duplicate, and a response that
    is a prefix of another one; the loss mask covers the responses.
    """
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(10, 2000, (n,), generator=g).tolist()

    first, second = tokens(PROMPT), tokens(PROMPT + 6)
    same_start = tokens(3)
    responses = [same_start + tokens(9), same_start + tokens(5), tokens(7)]
    responses += [responses[2], responses[0][:6]]
    rows = [(first, r) for r in responses] + [(second, tokens(n)) for n in (8, 11, 4)]
    rows.append((first[:5] + tokens(20), tokens(6)))
    return [{"input_ids": p + r, "loss_mask": [0] * len(p) + [1] * len(r)} for p, r in rows]


def test_runs_share_while_the_saving_does_not_drop():
    prompt = list(range(100, 140))
    a, b = prompt + [1], prompt + [2]  # share 39 positions: the label at position 39 differs
    c = prompt[:30] + [9] * 4  # cuts the run to 29 positions, but two reuses of 29 save more than one of 39
    d = prompt[:18] + [7] * 5  # would cut it to 17: three reuses of 17 save less than two of 29: a new run
    e = prompt[:18] + [7] * 3 + [8]  # shares 20 positions with d
    f = prompt[:MIN_SHARED_TOKENS] + [6]  # shares 15 positions with e: too few to share
    runs = runs_with_shared_prefix([a, b, c, d, e, f])
    assert runs == [([0, 1, 2], 29), ([3, 4], 20), ([5], MIN_SHARED_TOKENS)]


def test_compressed_row_holds_each_shared_prefix_once():
    examples = group_examples(0)
    (mb,) = pack(SequenceBatch.from_examples(examples), 0, 1, max_tokens=1000)
    row = SharedPrefixRow.build(mb)
    lengths = [len(e["input_ids"]) - 1 for e in examples]
    # First group: 5 sequences, the prompt's positions once (the responses' first tokens differ
    # between the third and the others). Second group: 3 sequences. The last shares too little.
    saved = 4 * (PROMPT - 1) + 2 * (PROMPT + 6 - 1)
    assert row.length == sum(lengths) - saved
    assert [len(b.branches) for b in row.blocks] == [5, 3, 1]
    # Every packed token maps to a compressed token with the same input, label and position.
    for name in ("input_ids", "labels", "position_ids"):
        assert torch.equal(getattr(row, name)[0, row.source], getattr(mb, name)[0]), name


@pytest.fixture(scope="module")
def models(tiny_model_path):
    def load(attention: str):
        return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation=attention)

    return load("rl2_varlen"), load("eager")


@pytest.mark.parametrize("trained_only, last_use", [(True, False), (False, False), (True, True)])
def test_log_probabilities_and_gradients_equal_each_sequence_alone(models, trained_only, last_use):
    """`last_use` (the trainers' case): the logits' gradient is written over them, with the same results."""
    model, reference = models
    examples = group_examples(1)
    (mb,) = pack(SequenceBatch.from_examples(examples), 0, 1, max_tokens=1000)
    model.parallel_layout = ModelLayout(share_prefixes=True)
    weights = torch.randn(mb.labels.shape, generator=torch.Generator().manual_seed(2))

    model.zero_grad()
    output = forward_packed(model, mb, trained_only=trained_only)
    assert output.shared is not None and output.local_length < mb.input_ids.shape[1]
    logps, entropy = output.logps_and_entropy(entropy_grad=True, last_use=last_use)
    ((logps + 0.1 * entropy) * weights * mb.loss_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if last_use:
        with pytest.raises(RuntimeError, match="last_use"):
            output.entropy()

    reference.zero_grad()
    expected_logps, expected_entropy, loss = [], [], 0.0
    for example, w, mask in zip(examples, mb.unpack(weights), mb.unpack(mb.loss_mask)):
        ids = torch.tensor([example["input_ids"]])
        log_probs = reference(input_ids=ids[:, :-1]).logits[0].float().log_softmax(-1)
        lp = log_probs.gather(-1, ids[0, 1:, None])[:, 0]
        ent = -(log_probs.exp() * log_probs).sum(-1)
        if trained_only:  # results are 0.0 where the label is not trained
            lp, ent = lp * mask, ent * mask
        expected_logps.append(lp)
        expected_entropy.append(ent)
        loss = loss + ((lp + 0.1 * ent) * w * mask).sum()
    loss.backward()

    torch.testing.assert_close(logps[0], torch.cat(expected_logps), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[0], torch.cat(expected_entropy), atol=1e-5, rtol=1e-5)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    model.parallel_layout = ModelLayout()


def test_no_shared_prefix_runs_the_packed_row(models):
    model, _ = models
    examples = [{"input_ids": list(range(10 + i, 40 + i)), "loss_mask": [1] * 30} for i in range(3)]
    (mb,) = pack(SequenceBatch.from_examples(examples), 0, 1, max_tokens=1000)
    assert SharedPrefixRow.build(mb) is None
    model.parallel_layout = ModelLayout(share_prefixes=True)
    assert forward_packed(model, mb).shared is None
    model.parallel_layout = ModelLayout()


def rollout(n_groups: int, group_size: int, prompt: int = PROMPT, response: int = 4):
    from RL2.batch import RolloutBatch

    examples = []
    for g in range(n_groups):
        for k in range(group_size):
            ids = [1000 + g] * prompt + [10 * k + t for t in range(1, response + 1)]
            examples.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * response})
    return RolloutBatch.single_turn(examples, [g for g in range(n_groups) for _ in range(group_size)])


def test_prompt_groups_go_into_micro_batches_whole_with_their_prompt_counted_once():
    from RL2.packing import prompt_group_units

    batch = rollout(3, 4)
    # Positions of one group: the prompt's but the last once, then each response's: the last prompt
    # token's label (the first response token) differs between the responses.
    group = (PROMPT - 1) + 4 * 4
    units, sizes = prompt_group_units(batch, dp_size=2, budget=1000)
    assert units == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] and sizes == [group] * 3
    # More ranks than groups: each group is cut in two, so that every rank gets work.
    units, sizes = prompt_group_units(batch, dp_size=4, budget=1000)
    assert units == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert sizes == [(PROMPT - 1) + 2 * 4] * 6
    # A budget that holds three of a group's sequences: cut into two chunks of two.
    units, _ = prompt_group_units(batch, dp_size=1, budget=(PROMPT - 1) + 3 * 4)
    assert units[:2] == [[0, 1], [2, 3]] and len(units) == 6
    # A budget below one sequence: one unit per sequence (pack then says it does not fit).
    units, sizes = prompt_group_units(batch, dp_size=1, budget=PROMPT)
    assert units == [[i] for i in range(12)] and sizes == [PROMPT + 3] * 12


def test_a_micro_batch_of_prompt_groups_runs_no_longer_than_planned():
    """Two groups whose prompts open alike (a chat template) but go on differently: the second's
    sequences must not join the first's run over the template, which would store its long prompt once
    per response and make the row longer than the packer planned."""
    from RL2.batch import RolloutBatch
    from RL2.models.shared_prefix import SharedPrefixRow
    from RL2.packing import pack, prompt_group_units

    template = list(range(500, 524))
    prompts = [template + list(range(600, 608)), template + list(range(700, 796))]  # 32 and 120 tokens
    examples = [{"input_ids": p + [10 * k + t for t in range(1, 9)], "loss_mask": [0] * len(p) + [1] * 8}
                for p in prompts for k in range(2)]
    batch = RolloutBatch.single_turn(examples, [0, 0, 1, 1])
    units, sizes = prompt_group_units(batch, dp_size=1, budget=1000)
    # each group: its prompt's positions but the last once, then 8 per response (by hand: 31 + 16, 119 + 16)
    assert units == [[0, 1], [2, 3]] and sizes == [47, 135]
    [mb] = pack(batch, 0, 1, sum(sizes), units=units, unit_sizes=sizes)
    row = SharedPrefixRow.build(mb)
    assert row.length == 47 + 135 and [(b.prefix, b.branches) for b in row.blocks] == [(31, [8, 8]), (119, [8, 8])]
