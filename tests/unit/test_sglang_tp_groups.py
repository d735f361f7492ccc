"""The tensor weight sync's groups (`_tp_groups`): every rank creates every group of `tp` consecutive ranks, and
each gets the one holding it. Run over gloo on 4 CPU ranks; the same code builds NCCL groups on GPUs."""

import json

from tests.helpers.launch import run_ranks

SCRIPT = """
import json, torch.distributed as dist
from RL2.engine.sglang.engine import _tp_groups
dist.init_process_group("gloo")
group = _tp_groups(dist.get_world_size(), 2)
print(json.dumps([dist.get_rank(), dist.get_process_group_ranks(group)]), flush=True)
dist.destroy_process_group()
"""


def test_each_rank_gets_the_group_of_its_block_of_tp_ranks(tmp_path):
    script = tmp_path / "groups.py"
    script.write_text(SCRIPT)
    result = run_ranks(4, [str(script)], timeout=120)
    groups = dict(json.loads(line) for line in result.stdout.splitlines() if line.startswith("["))
    assert groups == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
