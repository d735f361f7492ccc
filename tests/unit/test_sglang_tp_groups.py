"""The tensor weight sync's groups (`_tp_groups`): every rank creates every group of `tp` consecutive ranks, and
each gets the one holding it. Run over gloo on 4 CPU ranks; the same code builds NCCL groups on GPUs."""

import json

from tests.helpers.launch import run_ranks

SCRIPT = """
import json, pathlib, sys, torch.distributed as dist
from RL2.engine.sglang.engine import _tp_groups
dist.init_process_group("gloo")
group = _tp_groups(dist.get_world_size(), 2)
pathlib.Path(sys.argv[1], f"rank{dist.get_rank()}.json").write_text(json.dumps(dist.get_process_group_ranks(group)))
dist.destroy_process_group()
"""


def test_each_rank_gets_the_group_of_its_block_of_tp_ranks(tmp_path):
    script = tmp_path / "groups.py"
    script.write_text(SCRIPT)
    run_ranks(4, [str(script), str(tmp_path)], timeout=120)  # a file per rank: printed lines can interleave
    groups = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)}
    assert groups == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
