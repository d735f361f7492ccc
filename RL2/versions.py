"""The torch and transformers releases RL2 supports, checked when RL2 is imported. setup.py reads the same table
and runs this file before anything is installed, so only the standard library is imported here. The bounds are
releases RL2's tests ran with: torch 2.11 and transformers 5.17 in the GPU check's image and CI's oldest
environment (`.ci/run`), torch 2.14.1 and transformers 5.19.0 as SGLang 0.5.23 pins them (docs/gpus.md).
"""

import importlib.metadata
import re

# package: (lowest supported release, first release not supported)
SUPPORTED = {"torch": ("2.11", "2.15"), "transformers": ("5.17", "6")}


class UnsupportedVersion(ImportError):
    """A package RL2 depends on is installed at a release outside the range RL2 supports."""


def requirement(package: str) -> str:
    """The pip requirement of `package`, e.g. "torch>=2.11,<2.15"."""
    low, high = SUPPORTED[package]
    return f"{package}>={low},<{high}"


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.11.0+cu130" -> (2, 11, 0); a pre-release
    ("2.15.0.dev20261101", "6.0.0rc1") counts as its release."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group().split("."))


def check_supported_versions(installed=importlib.metadata.version) -> None:
    """Raise UnsupportedVersion naming the package, its installed version and the supported range when
    torch or transformers is outside it. `installed`: a package's installed version (for tests)."""
    for package, (low, high) in SUPPORTED.items():
        try:
            version = installed(package)
        except importlib.metadata.PackageNotFoundError:
            continue  # its import fails where it is needed, with Python's own message
        if not release(low) <= release(version) < release(high):
            raise UnsupportedVersion(
                f"RL2 supports {requirement(package)}, but this environment has {package} {version}: "
                f"install a supported release (pip install '{requirement(package)}')")
