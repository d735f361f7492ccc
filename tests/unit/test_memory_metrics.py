"""Per-phase time and peak resident memory (`RL2.utils.memory`), against tensors of known size."""

import mmap
import os

import pytest
import torch

from RL2.utils.memory import max_over_ranks, measured, peak_rss_gb, reset_peak_rss

LINUX = os.path.exists("/proc/self/clear_refs")


def resident_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


@pytest.mark.skipif(not LINUX, reason="the peak of a phase needs Linux's resettable RSS high-water mark")
def test_each_phase_reports_its_own_peak():
    metrics = {}
    with measured(metrics, "big"):
        before = resident_gb()
        # 0.4 GB mapped on its own (malloc may keep freed memory in the process: `keep_freed_memory`),
        # touched, and unmapped before the phase ends.
        block = mmap.mmap(-1, 400_000_000)
        torch.frombuffer(block, dtype=torch.uint8).fill_(1)
        block.close()
    with measured(metrics, "small"):
        after = resident_gb()
    assert metrics["perf/big_peak_gb"] >= before + 0.39
    # The mark was reset at the start of the second phase: it no longer holds the 0.4 GB block.
    assert metrics["perf/small_peak_gb"] < metrics["perf/big_peak_gb"] - 0.3
    assert metrics["perf/small_peak_gb"] >= after - 0.01
    assert metrics["perf/big_s"] >= 0 and metrics["perf/small_s"] >= 0
    reset_peak_rss()
    assert peak_rss_gb() < metrics["perf/big_peak_gb"] - 0.3


def test_max_over_ranks_adds_the_step_peak_at_world_size_one():
    metrics = {"perf/rollout_peak_gb": 1.5, "perf/actor_update_peak_gb": 2.5, "perf/rollout_s": 9.0}
    max_over_ranks(metrics, torch.device("cpu"))
    assert metrics == {"perf/rollout_peak_gb": 1.5, "perf/actor_update_peak_gb": 2.5, "perf/rollout_s": 9.0,
                       "perf/peak_gb": 2.5}


def test_gpu_peaks_have_a_step_peak_of_their_own():
    """GPU peaks (`*_gpu_peak_gb`) beside the RSS ones: each kind's step peak is the largest of its own kind."""
    metrics = {"perf/rollout_peak_gb": 1.5, "perf/actor_update_peak_gb": 2.5, "perf/rollout_gpu_peak_gb": 60.0,
               "perf/actor_update_gpu_peak_gb": 30.0}
    max_over_ranks(metrics, torch.device("cpu"))
    assert (metrics["perf/peak_gb"], metrics["perf/gpu_peak_gb"]) == (2.5, 60.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's peak needs a GPU")
def test_each_phase_reports_its_gpu_peak():
    torch.cuda.init()
    metrics = {}
    with measured(metrics, "big"):
        block = torch.empty(2**28, dtype=torch.uint8, device="cuda")  # 0.27 GB
        del block
    with measured(metrics, "small"):
        pass
    assert metrics["perf/big_gpu_peak_gb"] >= 0.268 > metrics["perf/small_gpu_peak_gb"] + 0.2
