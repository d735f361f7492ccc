"""Fixtures of the CUDA tests (models and configs are built by `cuda_models.py`)."""

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.gpu.cuda_models import llama_config
from tests.helpers.tiny import tokenizer_path


@pytest.fixture(scope="session")
def tokenizer():
    return AutoTokenizer.from_pretrained(tokenizer_path())


def save_llama(tokenizer, folder, sharpen: float) -> str:
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(tokenizer))
    with torch.no_grad():
        model.model.norm.weight.mul_(sharpen)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def model_path(tokenizer, tmp_path_factory) -> str:
    """Random weights, as initialised."""
    return save_llama(tokenizer, tmp_path_factory.mktemp("cuda_llama"), sharpen=1.0)


@pytest.fixture(scope="session")
def sharp_model_path(tokenizer, tmp_path_factory) -> str:
    """Random weights with the final norm scaled up: peaked next-token distributions, so that greedy
    choices do not hinge on round-off."""
    return save_llama(tokenizer, tmp_path_factory.mktemp("sharp_cuda_llama"), sharpen=10.0)
