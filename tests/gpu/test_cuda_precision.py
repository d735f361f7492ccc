"""`dtype=auto` on this GPU: bf16 only where its matmuls run in hardware (compute capability 8.0 and up);
a V100 or T4 emulates bf16, though torch's default `is_bf16_supported()` says True there."""

import pytest
import torch

from RL2.models.precision import compute_dtype, native_bf16

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_auto_is_bf16_only_on_ampere_or_newer():
    device = torch.device("cuda", 0)
    ampere = torch.cuda.get_device_capability(device)[0] >= 8
    assert native_bf16(device) is ampere
    assert compute_dtype("auto", device) is (torch.bfloat16 if ampere else torch.float32)
