"""A rank killed by a signal says where it was: `init_distributed` turns Python's faulthandler on, and
the test launcher puts what it printed first in a failure's message."""

import pytest

from tests.helpers.launch import run_ranks


def test_a_rank_killed_in_native_code_prints_its_stack():
    with pytest.raises(AssertionError) as failure:
        run_ranks(2, ["tests/e2e/scripts/crash_in_native_code.py"], timeout=120)
    # First in the message, before the tail of stderr (where the waiting peer's error follows it).
    report = str(failure.value).split(" failed:\n", 1)[1]
    assert report.startswith("Fatal Python error: Segmentation fault")
    assert "in read_address_zero" in report
