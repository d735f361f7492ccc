"""A CPU model that cannot fit this host's memory is refused before loading, naming its config key."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig

from RL2.config.schema import ModelConfig
from RL2.native.host_memory import check_model_fits_host, host_capacity_bytes, least_host_bytes
from RL2.parallel import ParallelDims
from RL2.workers.fsdp import FSDPWorker


def test_least_host_bytes_is_this_hosts_share_of_the_shards():
    # 1e9 parameters x 16 bytes over 4 ranks, 2 of them here: half of 16 GB.
    assert least_host_bytes(10**9, 16, shards=4, ranks_on_host=2) == 8 * 10**9


def meta_model(n_parameters: int) -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Linear(n_parameters // 1000, 1000, bias=False)


def test_the_floor_counts_trained_and_frozen_bytes_and_this_hosts_ranks(monkeypatch):
    capacity = host_capacity_bytes()
    # Twice this host's memory and swap if trained (16 bytes a parameter); half of it if frozen in float32.
    model = meta_model(capacity // 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(MemoryError, match=r"actor.model_name=big .*16 bytes a parameter"
                                          r".*1 rank\(s\), 1 of them on this host"):
        check_model_fits_host(model, "actor.model_name=big", True, torch.float32, shards=1)
    check_model_fits_host(model, "ref", False, torch.float32, shards=1)
    check_model_fits_host(model, "actor", True, torch.float32, shards=4)  # one host of four holds a quarter
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(MemoryError, match="4 rank\\(s\\), 4 of them"):
        check_model_fits_host(model, "actor", True, torch.float32, shards=4)


def test_the_worker_refuses_a_model_too_large_for_this_host_before_reading_weights(tmp_path, one_rank):
    # A 70B Llama's config, with no weights at all: the check must fail before anything is loaded.
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256).save_pretrained(tmp_path)
    cfg = OmegaConf.create({"actor": OmegaConf.structured(ModelConfig)})
    cfg.actor.model_name = str(tmp_path)
    with pytest.raises(MemoryError, match=rf"actor.model_name={tmp_path} has 70.\d\dB parameters.*LoRA"):
        FSDPWorker(cfg.actor, ParallelDims(1), torch.device("cpu"), total_steps=1, section="actor")
