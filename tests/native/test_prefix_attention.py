"""Shared-prefix attention in one C call (RL2/native/prefix_attention.c) against the same attention computed
in float64 as one SDPA call per prefix and per branch (the path it replaces on CPU, checked against each
sequence alone in test_shared_prefix.py)."""

import pytest
import torch

from RL2.models import shared_prefix
from RL2.models.shared_prefix import Block, SharedPrefixRow
from RL2.native import prefix_attention as kernel

pytestmark = pytest.mark.skipif(kernel._library() is None, reason="needs a C compiler")
SCALE = 0.125


def row_of(blocks: list[tuple[int, list[int]]]) -> SharedPrefixRow:
    """A row of blocks (prefix, branch lengths), laid out in order."""
    laid_out, start = [], 0
    for prefix, branches in blocks:
        laid_out.append(Block(start=start, prefix=prefix, branches=branches))
        start += prefix + sum(branches)
    return SharedPrefixRow(None, None, None, None, laid_out)


def test_runs_name_the_keys_each_token_sees():
    row = row_of([(3, [2, 0, 1]), (2, [])])
    # Block one: prefix tokens 0-2, branches 3-4 and 5; block two: tokens 6-7, a prefix with no branch.
    assert row.runs().tolist() == [
        [0, 0, 0, 0, 0, 0, 6, 6],  # prefix start
        [0, 0, 0, 3, 3, 3, 6, 6],  # prefix end: prefix tokens see no prefix run
        [0, 0, 0, 3, 3, 5, 6, 6],  # own start: the prefix's or the branch's first token
    ]


def sdpa_path(row, query, key, value):
    """The per-prefix, per-branch SDPA calls, however the kernel is set."""
    usable, shared_prefix.usable = shared_prefix.usable, lambda *tensors: False
    try:
        return row.attention(query, key, value, SCALE)
    finally:
        shared_prefix.usable = usable


def outputs_and_gradients(attend, inputs, grad_out):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = attend(*leaves)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), *(x.grad for x in leaves)]


ROWS = {
    "W1-like": [(48, [64, 64, 64, 64])] * 2,
    "uneven": [(20, [5, 0, 17, 1]), (33, []), (16, [2, 3, 40])],
}


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_sdpa_per_prefix_and_branch(heads, kv_heads, head_dim, rows, dtype):
    row = row_of(ROWS[rows])
    tokens = row.runs().shape[1]
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, n, tokens, head_dim, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads)]
    # Tokens-major storage, as a model's projections leave q, k and v.
    inputs = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in inputs]
    grad_out = torch.randn(1, tokens, heads, head_dim, generator=g)
    assert kernel.usable(*inputs)

    got = outputs_and_gradients(lambda q, k, v: row.attention(q, k, v, SCALE), inputs, grad_out)
    expected = outputs_and_gradients(lambda q, k, v: sdpa_path(row, q, k, v), [x.double() for x in inputs], grad_out)
    names = ["output", "grad q", "grad k", "grad v"]
    if dtype == torch.float32:
        for name, a, b in zip(names, got, expected):
            torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        return
    # bf16: no further from float64 than the SDPA calls it replaces (which round each branch's key and
    # value gradients to bf16 before summing them on the prefix; the kernel sums in float32).
    before = outputs_and_gradients(lambda q, k, v: sdpa_path(row, q, k, v), inputs, grad_out)
    for name, a, b, c in zip(names, got, expected, before):
        error, error_before = (a.double() - b).abs().max(), (c.double() - b).abs().max()
        assert error <= 1.05 * error_before, f"{name}: {error:.3g} from float64, SDPA's {error_before:.3g}"


def test_the_row_runs_the_kernel_where_it_applies():
    row = row_of([(16, [4, 4])])
    q, k, v = (torch.randn(1, n, 24, 64, requires_grad=True) for n in (4, 2, 2))
    out = row.attention(q, k, v, SCALE)
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "_PrefixAttentionBackward"
    # A head size the kernel's vectors do not divide, or a dtype it lacks: SDPA.
    narrow = [torch.randn(1, n, 24, 8) for n in (4, 2, 2)]
    assert not kernel.usable(*narrow)
    assert not kernel.usable(*(x.half() for x in (q, k, v)))
    torch.testing.assert_close(row.attention(*narrow, SCALE), sdpa_path(row, *narrow))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_model_with_the_kernel_scores_each_sequence_as_alone(tmp_path, monkeypatch, checkpointing):
    """Through a Llama whose head size the kernel takes: log-probs and gradients of a row of two prompt groups
    (shared prefixes, every attention through prefix_attention.c) against the model on each sequence alone."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from RL2.batch import SequenceBatch
    from RL2.models.checkpointing import enable_activation_checkpointing
    from RL2.models.logps import ModelLayout, forward_packed
    from RL2.packing import pack

    config = LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="rl2_varlen")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    model.train()  # as the trainers run it (checkpointing recomputes only in training mode); no dropout
    if checkpointing:
        enable_activation_checkpointing(model)
    g = torch.Generator().manual_seed(1)
    examples = []
    for prompt_length in (30, 21):
        prompt = torch.randint(0, 500, (prompt_length,), generator=g).tolist()
        for response_length in (9, 14, 1):
            response = torch.randint(0, 500, (response_length,), generator=g).tolist()
            examples.append({"input_ids": prompt + response, "loss_mask": [0] * prompt_length + [1] * response_length})
    (mb,) = pack(SequenceBatch.from_examples(examples), 0, 1, max_tokens=1000)
    model.parallel_layout = ModelLayout(share_prefixes=True)
    calls = []
    monkeypatch.setattr(shared_prefix, "prefix_attention",
                        lambda *args: calls.append(1) or kernel.prefix_attention(*args))

    with torch.no_grad():  # scoring: the kernel's forward without a graph
        scored = forward_packed(model, mb).logps()
    output = forward_packed(model, mb)
    assert output.shared is not None
    logps = output.logps()
    (logps * mb.loss_mask).sum().backward()

    expected, loss = [], 0.0
    for example, mask in zip(examples, mb.unpack(mb.loss_mask)):
        ids = torch.tensor([example["input_ids"]])
        lp = reference(input_ids=ids[:, :-1]).logits[0].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        expected.append(lp)
        loss = loss + (lp * mask).sum()
    loss.backward()
    assert len(calls) == 2 * (2 + checkpointing)  # two layers; scored, trained, and recomputed when checkpointed
    torch.testing.assert_close(logps[0], torch.cat(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scored, logps.detach())
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
