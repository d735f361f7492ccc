"""The GPU memory colocated SGLang servers leave free (`rollout.gpu_memory_margin_gb`, besides SGLang's own
headroom) holds what the trainer's process adds on the GPU after the servers have started: two PPO steps of
a tiny model, each ending with its weight push, take no more of the memory free with the trainer's state
offloaded than the margin. And a launched server's `mem_fraction_static` leaves that margin free."""

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("omegaconf", reason="the trainer's config needs omegaconf (`pip install -e .` installs it)")

from RL2.config.errors import ConfigError  # noqa: E402
from RL2.config.ppo_schema import COLOCATED_MARGIN_GB  # noqa: E402
from RL2.engine.memory_plan import COLOCATED_MEM_FRACTION, GIB  # noqa: E402
from RL2.engine.sglang.engine import _colocated_fraction  # noqa: E402
from tests.helpers.launch import run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_two_steps_and_their_pushes_keep_within_the_margin(tiny_model_path, tmp_path):
    out = tmp_path / "free.json"
    run_ranks(1, ["tests/e2e/scripts/offloaded_gpu_memory.py", str(out), tiny_model_path, str(tmp_path)],
              timeout=600, device="cuda")
    report = json.loads(out.read_text())
    assert len(report["weight_push_s"]) == 2 and all(s > 0 for s in report["weight_push_s"])  # each step pushed
    lost = report["free_before"] - report["free_after"]
    print(f"free GPU memory with the trainer's state offloaded: {report['free_before'] / GIB:.2f} GiB before the "
          f"steps, {lost / 2**20:.0f} MiB less after them (margin {COLOCATED_MARGIN_GB} GiB)")
    assert lost <= COLOCATED_MARGIN_GB * GIB, lost


def test_a_launched_servers_share_leaves_the_margin_free(one_rank):
    """`mem_fraction_static` of the memory free at the server's start is 0.85 of it less the margin (rounded
    down to a thousandth); a margin larger than that share stops the launch, naming the key."""
    device = torch.device("cuda", 0)
    margin = 2 * GIB
    fraction = _colocated_fraction(SimpleNamespace(gpu_memory_margin_gb=margin / GIB), device, tp=1)
    free, total = torch.cuda.mem_get_info(device)
    share = COLOCATED_MEM_FRACTION * free - margin
    assert share - 0.002 * free <= fraction * free <= share + 0.001 * free  # what the two measurements differ by
    with pytest.raises(ConfigError, match="rollout.gpu_memory_margin_gb"):
        _colocated_fraction(SimpleNamespace(gpu_memory_margin_gb=total / GIB), device, tp=1)
