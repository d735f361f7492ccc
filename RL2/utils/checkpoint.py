"""Resumable checkpoints `<save_dir>/step<N>/` (docs/outputs.md): every worker's shards, each rank's RNG state
and, written last, `trainer_state.json`, in a hidden temporary folder renamed into place; the small files and the
renames are fsynced. One run holds a save_dir at a time (`RL2.utils.save_dir_lock`)."""

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from RL2.config.errors import ConfigError
from RL2.parallel import all_gather_objects
from RL2.utils.checkpoint_metadata import SafeFileSystemReader, read_checkpoint_index
from RL2.utils.logging import fsync_dir, log_rank0, write_atomic, write_synced

STEP_DIR = re.compile(r"^step(\d+)$")
COMPLETE = "trainer_state.json"  # written last: a folder without it is not a checkpoint
LATEST = "latest.txt"  # names the checkpoint saved last, not the largest step (docs/outputs.md)


@contextmanager
def atomic_dir(path: str | Path):
    """Yield a temporary folder that replaces `path` only if the block finishes (single process); if it
    fails, the temporary folder is removed (a full disk is left no fuller than before)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:  # KeyboardInterrupt and torch's CheckpointException too
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def rng_state() -> dict:
    """This process's random streams (Python, NumPy, torch, CUDA) as tensors and plain numbers, which
    `torch.load(weights_only=True)` reads back running no code: NumPy's state tuple (an ndarray) would need
    `weights_only=False`, under which a planted `rng_rank*.pt` runs whatever it names at resume."""
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


def _on_every_rank(action: Callable[[], None]) -> None:
    """Run `action` on this rank; when it fails on any rank, raise on every rank. Collective. Each rank writes
    files of its own; a rank that failed alone (a full local disk) would otherwise leave the others waiting at
    the next collective. An interrupt (KeyboardInterrupt, SystemExit) is not shared: it ends this process."""
    error = None
    try:
        action()
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        error = e
    reasons = all_gather_objects(None if error is None else _reason(error))
    if error is not None:
        raise error
    for rank, reason in enumerate(reasons):
        if reason is not None:
            raise RuntimeError(f"saving the checkpoint failed on rank {rank} ({reason})")


def _reason(error: BaseException) -> str:
    if isinstance(error, CheckpointException):  # its str holds every rank's traceback: name the errors
        return "; ".join(sorted({f"{type(e).__name__}: {e}" for e, _ in error.failures.values()}))
    return f"{type(error).__name__}: {error}"


def save_checkpoint(save_dir: str, step: int, workers: dict, trainer_state: dict,
                    keep_last_n: int | None = None) -> Path:
    """Collective: every rank writes the shards of `workers` and its RNG state into `<save_dir>/step<step>`,
    beside `trainer_state.json`, and returns that folder. A save that fails on any rank (a full disk, an
    interrupt) removes its temporary folder and raises on every rank, leaving the checkpoints saved before."""
    final = Path(save_dir) / f"step{step}"
    tmp = final.with_name(f".{final.name}.tmp")
    rank = dist.get_rank()

    def write_shards() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(dict(workers), checkpoint_id=str(tmp))  # its FileSystemWriter fsyncs the shards
        with open(tmp / f"rng_rank{rank}.pt", "wb") as f:
            torch.save(rng_state(), f)
            f.flush()
            os.fsync(f.fileno())

    def publish() -> None:
        if rank != 0:
            return
        write_synced(tmp / COMPLETE, json.dumps({"step": step, **trainer_state}, indent=2))
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        write_atomic(final.with_name(LATEST), final.name)
        remove_old_checkpoints(final.parent, keep_last_n)

    try:
        _on_every_rank(write_shards)
        _on_every_rank(publish)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def remove_old_checkpoints(root: Path, keep_last_n: int | None) -> None:
    """Delete the temporary folders of saves that never finished (a run killed mid-save) and, with
    `keep_last_n`, every complete step folder but the newest n (by step), always keeping the one
    `latest.txt` names. Only the run that holds the save_dir's lock calls this."""
    for leftover in root.glob(".step*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep_last_n is None:
        return
    latest = latest_checkpoint(str(root))  # kept, and one of the n
    others = [path for _, path in sorted(_complete_steps(root), reverse=True) if path != latest]
    for path in others[max(0, keep_last_n - (latest is not None)):]:
        try:
            shutil.rmtree(path)
        except OSError as e:  # the new checkpoint is saved; a folder left behind only costs disk
            log_rank0(f"trainer.keep_last_n={keep_last_n}: could not delete {path} ({e.strerror}); delete it by hand")


def latest_checkpoint(save_dir: str) -> Path | None:
    """The complete step<N> folder saved last (`latest.txt`), else the one with the largest N, if any."""
    root = Path(save_dir)
    if not root.is_dir():
        return None
    pointer = root / LATEST
    if pointer.is_file():
        # Only a folder name of this save_dir: a pointer such as "../other_run/step9" or an absolute path
        # is not this run's checkpoint, whatever its last part is called.
        name = pointer.read_text().strip()
        if STEP_DIR.match(name) and (root / name / COMPLETE).exists():
            return root / name
    steps = _complete_steps(root)
    return max(steps)[1] if steps else None


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    """(N, folder) of every complete step<N> folder of `root`."""
    return [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / COMPLETE).exists()]


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
    """Collective: restore every worker and this rank's RNG; returns the trainer state. `rng_group`: ranks that
    must go on with one random stream, the tensor-parallel group (its ranks share inputs, and so dropout masks),
    even when another layout saved them (2 data-parallel ranks resumed as tp=2): each takes the stream of the
    group's first rank. None: this rank's own."""
    index = read_checkpoint_index(path)  # a planted index stops here, with its own message, on every rank
    try:
        dcp.load(dict(workers), checkpoint_id=str(path), storage_reader=SafeFileSystemReader(str(path), index))
    except CheckpointException as e:  # raised on every rank (DCP gathers the ranks' load plans)
        raise ConfigError(f"trainer.load_ckpt_from: {path} does not hold what this run's models are made of "
                          f"({_reason(e)}); resume with the model settings of the run that saved it "
                          f"(model_name, lora.*), or start afresh in another trainer.save_dir") from None
    source = dist.get_global_rank(rng_group, 0) if rng_group is not None else dist.get_rank()
    rng_file = path / f"rng_rank{source}.pt"
    if rng_file.exists():  # absent when resuming on a different number of ranks
        set_rng_state(load_rng_state(rng_file))
    return json.loads((path / COMPLETE).read_text())
