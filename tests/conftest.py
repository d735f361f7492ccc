import os

# Under pytest-xdist every worker, and every process a test starts, gets one torch thread: each worker then
# has a core to itself (on two cores, two workers), where torch's default of a thread per core would put twice
# as many threads as cores to work, spinning on each other. Set before torch is imported; torchrun gives its
# ranks one thread anyway, and a value the caller set wins.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from RL2.parallel import close_process_groups  # noqa: E402
from tests.helpers.tiny import make_tiny_model  # noqa: E402


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
