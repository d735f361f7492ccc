"""`dtype=auto`: bf16 where the hardware runs it faster than float32, by a rule on the hardware."""

from types import SimpleNamespace

import pytest
import torch

from RL2.models import precision

CPU = torch.device("cpu")


@pytest.fixture
def cpu_like(monkeypatch):
    """Make this process see a CPU with the given vendor, native bf16 and AMX."""

    def pretend(vendor: str, native: bool, amx: bool):
        monkeypatch.setattr(precision, "_cpu_vendor", lambda: vendor)
        monkeypatch.setattr(precision, "native_bf16", lambda device: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")

    return pretend


@pytest.mark.parametrize(
    "vendor, native, amx, expected",
    [
        ("GenuineIntel", True, True, torch.bfloat16),  # AMX
        ("GenuineIntel", True, False, torch.float32),  # AVX512-BF16 alone: half the float32 rate
        ("AuthenticAMD", True, False, torch.bfloat16),  # Zen 4: twice it
        ("AuthenticAMD", False, False, torch.float32),  # AVX2: bf16 emulated
        ("GenuineIntel", False, False, torch.float32),
    ],
)
def test_auto_takes_bf16_only_where_it_is_the_faster(cpu_like, vendor, native, amx, expected):
    cpu_like(vendor, native, amx)
    assert precision.compute_dtype("auto", CPU) is expected


def test_asking_for_bf16_where_it_is_slower_warns_and_obeys(cpu_like, monkeypatch):
    cpu_like("GenuineIntel", True, False)
    said = []
    monkeypatch.setattr(precision, "log_rank0", said.append)
    precision._warn_once.cache_clear()
    for _ in range(2):  # the trainer and the engine both ask: one warning
        assert precision.compute_dtype("bfloat16", CPU) is torch.bfloat16
    assert len(said) == 1 and "float32" in said[0] and "AMX" in said[0]
    assert precision.compute_dtype("float32", CPU) is torch.float32 and len(said) == 1


def test_the_vendor_is_read_from_cpuinfo():
    try:
        with open("/proc/cpuinfo") as f:
            vendors = {line.split(":")[1].strip() for line in f if line.startswith("vendor_id")}
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    if len(vendors) != 1:
        pytest.skip("no single vendor_id in /proc/cpuinfo")
    assert precision._cpu_vendor() == vendors.pop()


@pytest.mark.parametrize("major, native", [(7, False), (8, True), (9, True)])
def test_gpus_before_ampere_have_no_native_bf16(monkeypatch, major, native):
    """A V100 or T4 (compute capability 7.x) has no bf16 tensor cores, yet a bf16 tensor can be made on it,
    and torch's `is_bf16_supported()` then says True by default (emulation counts). The CUDA queries
    describe such a GPU to torch's own check: `auto` must stay float32 there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=major, minor=0))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # emulated bf16 works
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    assert precision.native_bf16(cuda) is native
    assert precision.compute_dtype("auto", cuda) is (torch.bfloat16 if native else torch.float32)
    said = []
    monkeypatch.setattr(precision, "log_rank0", said.append)
    precision._warn_once.cache_clear()
    assert precision.compute_dtype("bfloat16", cuda) is torch.bfloat16  # asked for: obeyed, with a warning
    assert bool(said) is not native and all("GPU" in s and "Ampere" in s for s in said)
