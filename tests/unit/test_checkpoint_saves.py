"""What a checkpoint save and resume may and may not do: RNG files that load without running code."""

import builtins
import random

import numpy as np
import pytest
import torch

from RL2.config import ConfigError
from RL2.utils.checkpoint import load_checkpoint, save_checkpoint


def draws() -> tuple:
    return random.random(), float(np.random.rand()), np.random.randn(3).tolist(), torch.rand(3).tolist()


# ---- RNG files ----


def test_a_resume_restores_every_random_stream(tmp_path, one_rank):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # NumPy holds a cached Gaussian: restored too
    path = save_checkpoint(str(tmp_path), 1, {}, {})
    expected = draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_checkpoint(path, {})
    assert draws() == expected
    # Tensors and plain numbers only: readable without unpickling any object.
    torch.load(path / "rng_rank0.pt", weights_only=True)


class Payload:
    """Unpickling this creates the file `marker`: what a planted RNG file could run instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def test_a_planted_rng_file_does_not_run_on_resume(tmp_path, one_rank):
    path = save_checkpoint(str(tmp_path / "run"), 1, {}, {})
    marker = tmp_path / "ran"
    torch.save({"python": Payload(marker), "numpy": None, "torch": torch.get_rng_state()}, path / "rng_rank0.pt")
    with pytest.raises(ConfigError, match=r"rng_rank0\.pt holds more than random-number state .* delete it to resume"):
        load_checkpoint(path, {})
    assert not marker.exists()
