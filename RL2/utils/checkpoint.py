"""Resumable checkpoints, written atomically.

`<save_dir>/step<N>/` holds every worker's shards (torch.distributed.checkpoint), each rank's RNG
state and `trainer_state.json` (step and anything else the trainer needs to continue). Everything
is written to a hidden temporary folder first and renamed into place at the end, so a crash
mid-save leaves the last complete checkpoint as it was.
"""

import json
import os
import random
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from RL2.config.errors import ConfigError

STEP_DIR = re.compile(r"^step(\d+)$")
COMPLETE = "trainer_state.json"  # written last: a folder without it is not a checkpoint
# The newest checkpoint this save_dir's runs wrote: after a resume from an older step, the folders
# of later steps the earlier run left are not what `latest` means.
LATEST = "latest.txt"


@contextmanager
def atomic_dir(path: str | Path):
    """Yield a temporary folder that replaces `path` only if the block finishes (single process)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


# ---- RNG state: tensors and plain numbers only, so that a resume reads it with weights_only=True ----


def rng_state() -> dict:
    """This process's random streams (Python, NumPy, torch, CUDA) as tensors and plain numbers.

    `torch.load(weights_only=True)` reads them back and runs no code from the file. A pickled object
    (NumPy's state tuple holds an ndarray) would need `weights_only=False`, under which a planted
    `rng_rank*.pt` runs whatever it names at resume.
    """
    version, mt, gauss = random.getstate()
    numpy = np.random.get_state(legacy=False)  # MT19937: {"state": {"key", "pos"}, "has_gauss", "gauss"}
    state = {
        "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"key": torch.from_numpy(numpy["state"]["key"].astype(np.int64)), "pos": int(numpy["state"]["pos"]),
                  "has_gauss": int(numpy["has_gauss"]), "gauss": float(numpy["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the streams `rng_state` returned."""
    python, numpy = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["mt"].tolist()), python["gauss"]))
    np.random.set_state({"bit_generator": "MT19937",
                         "state": {"key": numpy["key"].numpy().astype(np.uint32), "pos": numpy["pos"]},
                         "has_gauss": numpy["has_gauss"], "gauss": numpy["gauss"]})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_rng_state(path: Path) -> dict:
    """The state in RNG file `path` (`rng_rank<r>.pt`), read with weights_only=True: nothing in it runs."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # UnpicklingError for a pickled object; RuntimeError, EOFError for a damaged file
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"trainer.load_ckpt_from: {path} holds more than random-number state in tensors "
                          f"({type(e).__name__}: {reason}), so it is not loaded: it was written by an older RL2, "
                          f"damaged or planted. It holds only this rank's random streams: delete it to resume "
                          f"without them (weights and optimizer still load), or resume from another "
                          f"checkpoint") from None


def save_checkpoint(save_dir: str, step: int, workers: dict, trainer_state: dict) -> Path:
    """Collective: every rank writes its shards. Returns the final folder."""
    final = Path(save_dir) / f"step{step}"
    tmp = final.with_name(f".{final.name}.tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(dict(workers), checkpoint_id=str(tmp))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (tmp / COMPLETE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = final.with_name(f".{LATEST}.tmp")
        pointer.write_text(final.name)
        os.replace(pointer, final.with_name(LATEST))
    dist.barrier()
    return final


def latest_checkpoint(save_dir: str) -> Path | None:
    """The complete step<N> folder saved last (`latest.txt`), else the one with the largest N, if any."""
    root = Path(save_dir)
    if not root.is_dir():
        return None
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if STEP_DIR.match(named.name) and (named / COMPLETE).exists():
            return named
    steps = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / COMPLETE).exists()
    ]
    return max(steps)[1] if steps else None


def resolve_checkpoint(load_ckpt_from: str, save_dir: str) -> Path:
    """'latest' -> newest checkpoint in save_dir; otherwise a step<N> folder (a path, or a folder name
    inside save_dir), checked to be complete."""
    if load_ckpt_from == "latest":
        path = latest_checkpoint(save_dir)
        if path is None:
            raise FileNotFoundError(f"trainer.save_dir={save_dir} holds no complete checkpoint (step<N> folder)")
    else:
        path = Path(load_ckpt_from)
        if not path.exists() and (Path(save_dir) / load_ckpt_from).exists():
            path = Path(save_dir) / load_ckpt_from
        if not path.exists():
            raise FileNotFoundError(f"neither {path} nor {Path(save_dir) / load_ckpt_from} exists; "
                                    f"give 'latest' or a step<N> folder")
    if not (path / COMPLETE).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE}); pick another step folder")
    return path


def load_checkpoint(path: Path, workers: dict, rng_group: dist.ProcessGroup | None = None) -> dict:
    """Collective: restore every worker and this rank's RNG. Returns the trainer state.

    Args:
        rng_group: ranks that must go on with one random stream, the tensor-parallel group (its ranks
            share inputs, and so dropout masks): each takes the stream of the group's first rank. Under
            the layout that saved the checkpoint they held the same one; under another (2 data-parallel
            ranks resumed as tp=2) they would go on with different streams. None: this rank's own.
    """
    try:
        dcp.load(dict(workers), checkpoint_id=str(path))
    except CheckpointException as e:  # raised on every rank (DCP gathers the ranks' load plans)
        reasons = sorted({f"{type(error).__name__}: {error}" for error, _ in e.failures.values()})
        raise ConfigError(f"trainer.load_ckpt_from: {path} does not hold what this run's models are made of "
                          f"({'; '.join(reasons)}); resume with the model settings of the run that saved it "
                          f"(model_name, lora.*), or start afresh in another trainer.save_dir") from None
    source = dist.get_global_rank(rng_group, 0) if rng_group is not None else dist.get_rank()
    rng_file = path / f"rng_rank{source}.pt"
    if rng_file.exists():  # absent when resuming on a different number of ranks
        set_rng_state(load_rng_state(rng_file))
    return json.loads((path / COMPLETE).read_text())
