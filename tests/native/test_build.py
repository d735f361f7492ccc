"""Building the C libraries: `RL2_MARCH` picks the target gcc compiles for, and each target gets its own
build in the cache. The vector width the shared-prefix attention kernel was compiled with (its head-size
granule: four vectors of float32) tells which target a library was built for."""

import shutil

import pytest
import torch

from RL2.native import prefix_attention

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or not torch.cpu._is_avx2_supported(), reason="needs cc and an x86 CPU with AVX2"
)


def columns_of_a_build(monkeypatch, cache, march: str | None) -> int:
    monkeypatch.setenv("RL2_CACHE", str(cache))
    if march is None:
        monkeypatch.delenv("RL2_MARCH", raising=False)
    else:
        monkeypatch.setenv("RL2_MARCH", march)
    library = prefix_attention._library.__wrapped__()  # built again, past the process's cached library
    assert library is not None
    return library.prefix_attention_columns()


def test_rl2_march_builds_for_the_named_target_next_to_the_native_build(monkeypatch, tmp_path):
    native_columns = 64 if torch.cpu._is_avx512_supported() else 32  # 4 vectors of 16 or 8 float32 lanes
    assert columns_of_a_build(monkeypatch, tmp_path, None) == native_columns
    assert columns_of_a_build(monkeypatch, tmp_path, "x86-64-v3") == 32  # AVX2, on any x86 CPU that has it
    builds = sorted(path.name for path in (tmp_path / "kernels").glob("prefix_attention-*.so"))
    assert len(builds) == 2, builds


def test_a_target_the_compiler_does_not_know_is_a_warning_and_no_library(monkeypatch, tmp_path):
    monkeypatch.setenv("RL2_CACHE", str(tmp_path))
    monkeypatch.setenv("RL2_MARCH", "no-such-cpu")
    with pytest.warns(UserWarning, match="no-such-cpu"):
        library = prefix_attention._library.__wrapped__()
    assert library is None
