"""Loading a model from rank 0: the shards equal `from_pretrained`, and the full weights travel one tensor at a time.

Two gloo ranks on CPU. Rank 0 alone reads the checkpoint (into CPU memory); every rank builds the
sharded model on the meta device and receives its shards through broadcasts of one full tensor at a
time. The script records each broadcast made while the weights are handed out, and how many earlier
broadcast tensors were still alive then: with one tensor at a time, at most the previous one or two
(which the process group may hold until their work objects are dropped), however many parameters the
model has.
"""

import torch
from transformers import AutoModelForCausalLM

from tests.helpers.launch import run_ranks


def test_two_ranks_load_exactly_the_checkpoint_one_tensor_at_a_time(tiny_model_path, tmp_path):
    out = tmp_path / "loaded.pt"
    run_ranks(2, ["tests/e2e/scripts/load_from_rank0.py", tiny_model_path, str(out), "bfloat16"])
    results = torch.load(out)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    expected = dict(reference.named_parameters())
    largest = max(p.numel() for p in expected.values())
    n_state = len(reference.state_dict())  # tied embeddings appear twice
    for name, dtype in (("trained", torch.float32), ("frozen", torch.bfloat16)):
        result = results[name]
        # Trained models keep float32 master weights; frozen ones are stored in the compute dtype.
        assert set(result["params"]) == set(expected)
        for key, param in result["params"].items():
            assert param.dtype == dtype, key
            assert torch.equal(param, expected[key].detach().to(dtype)), f"{name} {key}"
        for key, buffer in reference.named_buffers():
            torch.testing.assert_close(result["buffers"][key].float(), buffer.float(), msg=key)
        for rank, records in enumerate(result["records"]):
            assert len(records) == n_state, (name, rank)
            assert max(numel for numel, _ in records) == largest
            # A bounded few earlier tensors: gloo's finished work objects may hold the last one or two
            # a moment longer on a busy machine. Never the whole model (21 tensors here).
            assert max(alive for _, alive in records) <= 2, f"{name} rank {rank}: earlier full tensors kept: {records}"
        # Each rank keeps half of every parameter (the 64-row embedding splits evenly).
        assert result["local_numel"] * 2 == sum(p.numel() for p in expected.values())
