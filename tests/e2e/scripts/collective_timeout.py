"""Two ranks: rank 0 waits in collectives that rank 1 never joins, on the world group and on a group
made after it (as the device mesh's and the servers' groups are). tests/e2e/test_collective_timeout.py
checks that each wait ends after `trainer.collective_timeout` seconds rather than torch's 30 minutes.

    torchrun --nproc_per_node=2 tests/e2e/scripts/collective_timeout.py OUT.json key=value ...
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from RL2.config.cli import parse_config
from RL2.config.schema import SFTConfig
from RL2.parallel import collective_timeout, init_distributed


def main(out: str, *overrides: str) -> None:
    cfg = parse_config(SFTConfig, "sft", list(overrides))
    init_distributed(torch.device("cpu"), collective_timeout(cfg))
    later = dist.new_group([0, 1])
    done = Path(out)
    if dist.get_rank() == 1:  # away until rank 0 has given up on both collectives
        deadline = time.monotonic() + 60  # then its exit ends any wait left
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    else:
        waits = {}
        for name, group in (("world", None), ("later", later)):
            began = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=group)
                error = None
            except RuntimeError as e:
                error = str(e)
            waits[name] = {"seconds": time.monotonic() - began, "error": error}
        done.write_text(json.dumps(waits))
    # Rank 0's groups are broken by the timeouts: leave without their teardown, which would wait on them.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
