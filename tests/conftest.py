import pytest
import torch.distributed as dist

from RL2.engine.sglang.server import free_port
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tok():
    from tests.helpers.tiny import tokenizer

    return tokenizer()


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo process group, for code whose steps are collectives at world size 1 too."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
