"""Parallel layouts (data, tensor, context, hybrid sharding) against one plain process.

The reference is a Hugging Face model run sequence by sequence in this process, with no packing and
no RL2 code on the path: the loss, per-token log-probs, entropies, gradients and the weights after
one AdamW step of every layout must equal it. The weights compared are those the embedded engine
receives (`full_tensors`) and those the export writes.
"""

import importlib.util

import pytest
import torch

from tests.unit.test_config import one_process, refuse_models  # noqa: F401  (one_process: a fixture)

SCRIPT = "tests/e2e/scripts/parallel_equivalence.py"


def test_zigzag_layout_covers_every_token_once_and_balances_work():
    from RL2.models.context_parallel import zigzag_layout

    bounds = [0, 70, 82, 83, 116]  # lengths 70, 12, 1, 33
    for size in (2, 4):
        rows, positions, chunks = zigzag_layout(bounds, size)
        real = sorted(r for rank in rows for r in rank if r >= 0)
        assert real == list(range(bounds[-1]))
        assert len({len(rank) for rank in rows}) == 1  # the same number of tokens on every rank
        # Causal attention work of a token ~ its position + 1: equal on every rank after padding.
        work = [sum(p + 1 for p in rank) for rank in positions]
        assert len(set(work)) == 1
        for rank_rows, rank_positions in zip(rows, positions):
            for row, position in zip(rank_rows, rank_positions):
                if row >= 0:
                    start = max(b for b in bounds if b <= row)
                    assert position == row - start
        assert chunks == [-(-n // (2 * size)) for n in (70, 12, 1, 33)]


def test_layout_errors_name_every_degree():
    from RL2.models.tensor_parallel import check_tp_degree
    from RL2.parallel import ParallelDims

    with pytest.raises(ValueError, match=r"6 ranks .* ddp_size=1 x cp_size=2 x tp_size=4 = 8 .*actor.tp_size"):
        ParallelDims(world_size=6, tp=4, cp=2)
    dims = ParallelDims(world_size=8, tp=2, cp=2)
    assert (dims.ddp, dims.fsdp, dims.dp, dims.seq_parallel) == (1, 2, 2, 4)
    assert dims.describe() == "world size 8 = ddp 1 x fsdp 2 x cp 2 x tp 2 (dp=2)"
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match="tp_size=4 must divide the model's num_key_value_heads=2"):
        check_tp_degree(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128), 4)
    with pytest.raises(ValueError, match="no tensor-parallel plan for model type 'gpt2'"):
        check_tp_degree(GPT2Config(), 2)


def test_micro_batch_budget_grows_with_cp_and_tp():
    from RL2.batch import SequenceBatch
    from RL2.packing import pack

    batch = SequenceBatch.from_examples([{"input_ids": list(range(71)), "loss_mask": [1] * 71},
                                         {"input_ids": list(range(9)), "loss_mask": [1] * 9}])
    with pytest.raises(ValueError, match=r"70 tokens does not fit in actor.max_length_per_device=40;"):
        pack(batch, 0, 1, 40)
    with pytest.raises(ValueError, match=r"70 tokens does not fit in actor.max_length_per_device=30 "
                                         r"x cp_size \* tp_size=2"):
        pack(batch, 0, 1, 30, seq_parallel=2)
    micro = pack(batch, 0, 1, 40, seq_parallel=2)  # cp and tp ranks share one 80-token micro-batch
    assert [mb.input_ids.shape[1] for mb in micro] == [78]


def test_vocab_shard_on_one_rank_matches_torch():
    from RL2.models.vocab_parallel import VocabShard

    logits = torch.randn(1, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (1, 5))
    vocab = VocabShard()
    log_probs = torch.log_softmax(logits, -1)
    torch.testing.assert_close(vocab.token_logps(logits, labels).double(),
                               log_probs.gather(-1, labels[..., None]).squeeze(-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vocab.entropy(logits).double(), -(log_probs.exp() * log_probs).sum(-1),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("ring_flash_attn") is None,
                    reason="needs CUDA and ring-flash-attn")
def test_ring_flash_attn_loads_without_its_package_init():
    from RL2.models.context_parallel import _ring_flash_attn_module

    assert callable(_ring_flash_attn_module().zigzag_ring_flash_attn_varlen_func)


def test_more_ranks_than_gpus_fails_naming_both(monkeypatch):
    """LOCAL_RANK 3 on a node where this process sees 2 GPUs: a clear error instead of an invalid device."""
    from RL2.parallel import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=3 but this process sees 2 GPU\(s\).*--nproc_per_node=2"):
        pick_device("auto")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pick_device("cuda") == torch.device("cuda", 1)


def test_a_task_given_one_gpu_of_its_own_uses_it(monkeypatch):
    """SLURM's --gpus-per-task=1: each rank sees one GPU, its own (CUDA_VISIBLE_DEVICES names it), at index 0
    whatever its LOCAL_RANK; one GPU seen without such an assignment is still refused for LOCAL_RANK 1."""
    from RL2.parallel import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert pick_device("auto") == torch.device("cuda", 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=3 but this process sees 1 GPU\(s\)"):
        pick_device("cuda")


def test_cuda_asked_for_without_cuda_names_the_key_that_asked(monkeypatch, tmp_path):
    """The evaluator's switch is eval.device: its error must not send the user to trainer.device."""
    from RL2.evaluate import main
    from tests.helpers import REPO

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "test.jsonl").write_text('{"prompt": "1 + 1?", "extra_info": {"answer": "2"}}\n')
    with pytest.raises(SystemExit, match=r"^RL2 evaluate: eval\.device=cuda but CUDA is not available; use "
                                         r"eval\.device=auto or cpu$"):
        main([f"data.test.path={tmp_path / 'test.jsonl'}", f"rollout.env_path={REPO / 'envs' / 'arithmetic.py'}",
              "eval.device=cuda"])


@pytest.mark.parametrize("degree, message", [
    ("actor.tp_size=0", r"^RL2 sft: actor\.tp_size=0: a parallel degree is at least 1; set it to 1 or more$"),
    ("actor.cp_size=2", r"^RL2 sft: cannot lay out 1 ranks as ddp x fsdp x cp x tp: ddp_size=1 x cp_size=2 x "
                        r"tp_size=1 = 2 does not divide the world size .* Set actor\.ddp_size, actor\.cp_size"),
])
def test_a_layout_that_does_not_fit_ends_the_run_with_a_message(degree, message, tmp_path, monkeypatch, one_process):
    """Like every config error, a parallel layout that cannot be built ends the run with one line naming the
    keys, not with a traceback on every rank."""
    from RL2.trainer import sft

    refuse_models(monkeypatch)
    with pytest.raises(SystemExit, match=message):
        sft.main(["data.train.path=unused.jsonl", f"trainer.save_dir={tmp_path / 'run'}", degree])
