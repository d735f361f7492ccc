"""Offloading into locked-page buffers with FSDP2's padding of uneven shards, on two gloo ranks."""

from tests.helpers import REPO
from tests.helpers.launch import run_ranks


def test_uneven_shards_moved_into_host_buffers_take_the_same_steps():
    result = run_ranks(2, [str(REPO / "tests/e2e/scripts/pinned_offload_fsdp.py")], timeout=180)
    assert result.stdout.count("ok") == 2
