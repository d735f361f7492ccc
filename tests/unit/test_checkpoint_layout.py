"""Weight pushes of mixture-of-experts policies: transformers holds the experts fused, checkpoints and
SGLang one tensor per expert (`RL2.engine.checkpoint_layout`).

Tiny random Qwen3-MoE and Mixtral models (4 experts, 2 per token). Each expectation is independent of
the mapping: the logits of the policy's own forward, the names `save_pretrained` wrote, the log-softmax
of a full forward.
"""

import asyncio

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from RL2.engine.checkpoint_layout import CheckpointLayout, checkpoint_tensor_names
from RL2.engine.embedded.engine import EmbeddedEngine
from RL2.engine.sglang.engine import SGLangEngine, unwritten_weights
from tests.helpers.tiny import make_tiny_moe

PROMPT = [1, 9690, 198, 2683, 359, 253, 42, 77]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_path(request, tmp_path_factory) -> str:
    return make_tiny_moe(tmp_path_factory.mktemp(request.param), request.param)


def trained(path: str, seed: int = 1) -> torch.nn.Module:
    """The model at `path` with every weight moved: a policy after some updates, unlike its checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 0.5 * torch.randn_like(param))
    return model


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(torch.tensor([PROMPT])).logits[0]


def test_the_policys_memory_layout_differs_from_its_checkpoint(moe_path):
    """What the mapping is for: transformers' names of the experts are not in the checkpoint."""
    in_memory = {name for name, _ in AutoModelForCausalLM.from_pretrained(moe_path).named_parameters()}
    on_disk = checkpoint_tensor_names(moe_path)
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= in_memory
    assert not {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} & on_disk
    assert CheckpointLayout.from_folder(moe_path).checkpoint_names() == on_disk


def test_a_disk_push_writes_a_folder_that_loads_as_the_policy(moe_path, tmp_path, one_rank):
    """The SGLang engine's disk push (rollout.weight_sync=disk) of the policy's in-memory parameters, in
    64 kB buckets: the folder has the checkpoint's names, and the model transformers loads from it gives
    the policy's logits."""
    policy = trained(moe_path)
    # This rank writes the folder and controls no server (as a writing rank of a host whose servers
    # other ranks control): the push is the folder alone.
    engine = SGLangEngine(["http://127.0.0.1:9"], [], "disk", 2**16, moe_path, weights_dir=tmp_path / "weights")
    engine.update_weights(policy.named_parameters(), weight_version="step1")
    folder = tmp_path / "weights" / "step1"
    assert checkpoint_tensor_names(folder) == checkpoint_tensor_names(moe_path)
    assert len(list(folder.glob("*.safetensors"))) > 2
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(loaded), logits(policy), rtol=0, atol=1e-5)
    assert not torch.allclose(logits(loaded), logits(AutoModelForCausalLM.from_pretrained(moe_path).eval()))


def test_the_tensors_are_those_save_pretrained_writes(moe_path, tmp_path):
    """Expert by expert, the mapped tensors equal what transformers' own `save_pretrained` writes."""
    policy = trained(moe_path, seed=2)
    policy.save_pretrained(tmp_path)
    mapped = dict(CheckpointLayout.from_folder(moe_path).to_checkpoint(policy.named_parameters()))
    with safe_open(tmp_path / "model.safetensors", framework="pt") as saved:
        assert set(saved.keys()) == set(mapped)
        for name in saved.keys():
            assert torch.equal(saved.get_tensor(name), mapped[name]), name


def test_a_layers_experts_go_out_as_soon_as_their_tensors_came(moe_path):
    """The mapping streams: one fused tensor in, its experts out, before the next parameter is read."""
    layout = CheckpointLayout.from_folder(moe_path)
    policy = trained(moe_path)
    read = []

    def parameters():
        for name, param in policy.named_parameters():
            read.append(name)
            yield name, param

    for name, _ in layout.to_checkpoint(parameters()):
        if ".experts.0." in name:
            assert read[-1].endswith(("experts.gate_up_proj", "experts.down_proj")), (name, read[-1])


def test_a_stream_missing_one_half_of_a_converted_group_is_refused(moe_path):
    """A converter given part of its tensors would write wrong experts: the stream fails, naming the part."""
    layout = CheckpointLayout.from_folder(moe_path)
    # Each group of these families is one fused tensor; a reverse conversion that joins several tensors
    # (a checkpoint's fused projection that transformers splits) has groups of more: one here.
    layout.members = {"group": {"a", "b"}}
    layout.group_of = {"a": "group", "b": "group"}
    with pytest.raises(ValueError, match="never came.*: b"):
        list(layout.to_checkpoint([("a", torch.zeros(1))]))


def test_a_dense_models_names_pass_through(tiny_model_path):
    layout = CheckpointLayout.from_folder(tiny_model_path)
    named = list(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())
    assert not layout.converts and layout.to_checkpoint(named) is named
    assert layout.checkpoint_names() == checkpoint_tensor_names(tiny_model_path)


def test_the_embedded_engine_takes_the_in_memory_layout(moe_path):
    """The embedded engine holds transformers' model itself: a push of the policy's parameters as they
    are (after its weights were released) serves the policy's log-probabilities and greedy tokens."""
    policy = trained(moe_path, seed=3)
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    engine = EmbeddedEngine(model, AutoTokenizer.from_pretrained(moe_path), max_running_requests=4, owns_model=True)
    try:
        engine.release_memory(["weights", "kv_cache"])
        engine.update_weights(policy.named_parameters(), weight_version="v1")

        async def main():
            params = {"max_new_tokens": 8, "ignore_eos": True}
            return await asyncio.gather(*(engine.generate({"input_ids": PROMPT, "return_logprob": True,
                                                           "sampling_params": params | {"temperature": t}})
                                          for t in (1.0, 0.0)))

        sampled, greedy = asyncio.run(main())
    finally:
        engine.shutdown()
    tokens = sampled["output_ids"]
    with torch.no_grad():
        full = policy(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
    expected = torch.log_softmax(full, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in sampled["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(policy(torch.tensor([ids])).logits[0, -1].argmax()))
    assert greedy["output_ids"] == ids[len(PROMPT):]


def checksums(rank: int, tp_size: int, **values) -> dict:
    info = {"role": "target", "tp_rank": rank, "tp_size": tp_size, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
            "pp_size": 1, "rank": rank, "size": tp_size}
    return {"checksums": values, "per_gpu_checksum": "x", "parallelism_info": [info]}


def test_unwritten_weights_are_those_whose_checksum_did_not_change():
    """SGLang's /weights_checker answers, one entry per GPU of the server (here two tensor-parallel ranks)."""
    before = {"success": True, "ranks": [checksums(0, 2, qkv="a", w13="b"), checksums(1, 2, qkv="c", w13="d")]}
    after = {"success": True, "ranks": [checksums(1, 2, qkv="e", w13="d"), checksums(0, 2, qkv="f", w13="g")]}
    assert unwritten_weights(before, after) == ["w13 (tp rank 1)"]
    one = {"ranks": [checksums(0, 1, embed="a", w2="b")]}
    assert unwritten_weights(one, {"ranks": [checksums(0, 1, embed="c", w2="b")]}) == ["w2"]
    assert unwritten_weights(one, {"ranks": [checksums(0, 1, embed="c", w2="d")]}) == []
