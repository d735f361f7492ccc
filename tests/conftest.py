import pytest
import torch.distributed as dist

from RL2.parallel import close_process_groups
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
    # In-process keys and a group freed afterwards, as RL2's own one-rank runs do: no store server or gloo
    # thread of this fixture outlives the module into the test process's exit.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    close_process_groups()
