"""The supported torch and transformers releases (`RL2.versions`): one table read by setup.py and checked
when RL2 is imported, so that an unsupported release stops with one line instead of an ImportError from
deep inside. CI also runs a PPO step at the lowest supported releases (tests/e2e/test_lowest_versions.py)."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from RL2.versions import SUPPORTED, UnsupportedVersion, check_supported_versions, release

REPO = Path(__file__).resolve().parents[2]


def installed(**versions):
    def version(package):
        if package not in versions:
            raise importlib.metadata.PackageNotFoundError(package)
        return versions[package]
    return version


@pytest.mark.parametrize("torch, transformers", [("2.11.0+cu130", "5.17.0"), ("2.13.0+cpu", "5.24.0"),
                                                 ("2.14.1", "5.19.0"), ("2.14.9", "5.99.1")])
def test_releases_in_the_range_pass(torch, transformers):
    check_supported_versions(installed(torch=torch, transformers=transformers))


@pytest.mark.parametrize("package, version, other", [
    ("transformers", "5.16.2", {"torch": "2.13.0"}),
    ("transformers", "6.0.0rc1", {"torch": "2.13.0"}),
    ("torch", "2.10.0+cu128", {"transformers": "5.19.0"}),
    ("torch", "2.15.0.dev20261101", {"transformers": "5.19.0"}),
])
def test_a_release_outside_the_range_is_named_with_the_range(package, version, other):
    with pytest.raises(UnsupportedVersion) as raised:
        check_supported_versions(installed(**{package: version}, **other))
    low, high = SUPPORTED[package]
    assert str(raised.value) == (f"RL2 supports {package}>={low},<{high}, but this environment has {package} "
                                 f"{version}: install a supported release (pip install '{package}>={low},<{high}')")


def test_releases_compare_by_number_not_by_text():
    assert release("2.9.1") < release("2.11") <= release("2.11.0+cu130") < release("2.14.1") < release("2.15")
    assert release("5.17.0") < release("5.100")


def test_setup_py_declares_the_same_ranges(tmp_path):
    """What pip installs and what the import accepts cannot drift apart."""
    metadata = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
                              cwd=REPO, capture_output=True, text=True)
    assert metadata.returncode == 0, metadata.stderr[-2000:]
    requires = (tmp_path / "RL2.egg-info" / "requires.txt").read_text().splitlines()
    for package, (low, high) in SUPPORTED.items():
        assert any(line.replace(" ", "") in (f"{package}<{high},>={low}", f"{package}>={low},<{high}")
                   for line in requires), requires


def test_importing_rl2_with_an_unsupported_transformers_stops_with_that_line(tmp_path):
    """In a fresh interpreter whose transformers metadata says 5.16.0 (a dist-info folder ahead of the real
    one on the path), `import RL2` raises the one line, before any module of RL2 imports transformers."""
    info = tmp_path / "transformers-5.16.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.16.0\n")
    result = subprocess.run([sys.executable, "-c", "import RL2"], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "RL2.versions.UnsupportedVersion: RL2 supports transformers>=5.17,<6, but this environment has "
        "transformers 5.16.0: install a supported release (pip install 'transformers>=5.17,<6')")
    assert "import transformers" not in result.stderr
