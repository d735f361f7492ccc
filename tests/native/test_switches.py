"""The RL2_* switches (`RL2/native/switches.py`): each is on unless set to "0", and with it off the code
takes its fallback, which computes the same. RL2_FUSED_LAYERS is checked in test_fused_layers.py,
RL2_MARCH and RL2_CACHE in test_build.py, RL2_KEEP_FREED_MEMORY in tests/e2e/test_allocator.py."""

import shutil

import pytest
import torch

from RL2.models import chunked_logps
from RL2.models.shared_prefix import Block, SharedPrefixRow
from RL2.native import decode_kernels, pinned_offload, prefix_attention, switches
from RL2.native.shared_memory_collectives import SharedMemoryCollectives

SWITCHES = {
    "RL2_FUSED_LAYERS": switches.fused_layers,
    "RL2_PREFIX_ATTENTION": switches.prefix_attention,
    "RL2_DECODE_KERNELS": switches.decode_kernels,
    "RL2_KEEP_FREED_MEMORY": switches.keep_freed_memory,
    "RL2_PINNED_OFFLOAD": switches.pinned_offload,
    "RL2_SHARED_MEMORY_COLLECTIVES": switches.shared_memory_collectives,
    "RL2_TRITON_LOGPS": switches.triton_logps,
}
HAS_COMPILER = bool(shutil.which("cc") or shutil.which("gcc"))


@pytest.mark.parametrize("name", SWITCHES)
def test_a_switch_is_on_unless_set_to_0(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert SWITCHES[name]() is True
    for value, on in (("1", True), ("yes", True), ("0", False)):
        monkeypatch.setenv(name, value)
        assert SWITCHES[name]() is on


@pytest.fixture
def fresh_libraries():
    """The loaders cache their library per process: cleared around a test that changes a switch."""
    loaders = (prefix_attention._library, decode_kernels.load_decode_kernels, chunked_logps.cuda_kernels)
    for loader in loaders:
        loader.cache_clear()
    yield
    for loader in loaders:
        loader.cache_clear()


def attention_by_hand(query, key, value, blocks: list[Block], scale: float) -> torch.Tensor:
    """Each token attends to its block's prefix and causally to its own prefix or branch, in float64,
    one token at a time: `[1, H, T, D]` -> `[1, T, H, D]`."""
    sees = []
    for block in blocks:
        prefix = list(range(block.start, block.start + block.prefix))
        sees += [prefix[: i + 1] for i in range(block.prefix)]
        first = block.start + block.prefix
        for length in block.branches:
            sees += [prefix + list(range(first, first + i + 1)) for i in range(length)]
            first += length
    q, k, v = (x[0].double() for x in (query, key, value))
    k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], dim=0) for x in (k, v))
    out = torch.stack([(torch.softmax(q[:, t, None] @ k[:, keys].mT * scale, -1) @ v[:, keys])[:, 0]
                       for t, keys in enumerate(sees)])
    return out.unsqueeze(0)


@pytest.mark.skipif(not HAS_COMPILER, reason="needs a C compiler")
@pytest.mark.parametrize("on", [True, False])
def test_prefix_attention_switch_picks_the_kernel_or_sdpa_with_the_same_result(on, monkeypatch, fresh_libraries):
    monkeypatch.setenv("RL2_PREFIX_ATTENTION", "1" if on else "0")
    blocks = [Block(start=0, prefix=20, branches=[5, 0, 9]), Block(start=34, prefix=17, branches=[3])]
    row = SharedPrefixRow(None, None, None, None, blocks)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 54, 64, generator=generator)
    key, value = (torch.randn(1, 2, 54, 64, generator=generator) for _ in range(2))
    assert prefix_attention.usable(query, key, value) is on
    got = row.attention(query, key, value, 0.125)
    torch.testing.assert_close(got.double(), attention_by_hand(query, key, value, blocks, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_COMPILER, reason="needs a C compiler")
def test_decode_kernels_switch(monkeypatch, fresh_libraries):
    monkeypatch.setenv("RL2_DECODE_KERNELS", "0")
    assert decode_kernels.load_decode_kernels() is None
    decode_kernels.load_decode_kernels.cache_clear()
    monkeypatch.delenv("RL2_DECODE_KERNELS")
    assert isinstance(decode_kernels.load_decode_kernels(), decode_kernels.DecodeKernels)


def test_triton_logps_switch_keeps_the_chunked_path(monkeypatch, fresh_libraries):
    monkeypatch.setenv("RL2_TRITON_LOGPS", "0")
    assert chunked_logps.cuda_kernels() is None


def test_shared_memory_collectives_switch_leaves_the_group_to_gloo(monkeypatch):
    monkeypatch.setenv("RL2_SHARED_MEMORY_COLLECTIVES", "0")
    group = object()  # not a process group: switched off, nothing may ask it anything
    assert SharedMemoryCollectives.for_group.__wrapped__(SharedMemoryCollectives, group) is None


@pytest.mark.parametrize("value, expected", [(None, True), ("0", False)])
def test_pinned_offload_switch(value, expected, monkeypatch):
    if value is None:
        monkeypatch.delenv("RL2_PINNED_OFFLOAD", raising=False)
    else:
        monkeypatch.setenv("RL2_PINNED_OFFLOAD", value)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert pinned_offload(cuda, cpu) is expected
    assert not pinned_offload(cpu, cpu) and not pinned_offload(cpu, cuda) and not pinned_offload(cuda, cuda)
