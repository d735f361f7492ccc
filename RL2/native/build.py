"""C libraries built on first use with the system C compiler for this CPU (or `RL2_MARCH`) into the RL2 cache, and
called through ctypes (docs/native.md). They link `libgomp.so.1`, which torch has already loaded on Linux, so they
share torch's OpenMP thread pool instead of starting a second one that would compete for the same cores."""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from RL2.native import switches

# The C functions' argument types, and the suffix of each dtype's kernel in the C files that have one per dtype.
INT, FLOAT, POINTER = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
SUFFIXES = {torch.float32: "_f32", torch.bfloat16: "_bf16"}
HEADERS = Path(__file__).with_name("include")  # fast_math.h, which the sources include
# Not -ffast-math: results must stay IEEE. Without trapping math and errno, gcc may vectorise the
# comparisons and rounding in exp (they change no value, only whether FP exceptions can be observed).
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


def cpuinfo(field: str) -> str:
    """The value of `field` ("flags", "vendor_id") for the first CPU in /proc/cpuinfo; "" where there is none."""
    try:
        with open("/proc/cpuinfo") as lines:
            return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(field)), "")
    except OSError:
        return ""


def _build(source: Path, compiler: str) -> Path:
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(HEADERS.glob("*.h")))
    flags = [f"-march={switches.march()}" if flag == "-march=native" else flag for flag in FLAGS]
    cpu = cpuinfo("flags") or platform.processor()
    key = hashlib.sha256(text + " ".join([compiler, *flags, cpu]).encode()).hexdigest()[:16]
    library = switches.cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # Every rank may build at once: each into its own file, then an atomic rename.
    handle, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
    os.close(handle)
    try:
        command = [compiler, *flags, f"-I{HEADERS}", str(source), "-o", partial, "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True)
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


def load_library(source: Path, enabled: bool, fallback: str, signatures: dict, returns: dict) -> ctypes.CDLL | None:
    """`source` built (if needed) and loaded, its functions typed; None when its switch (`enabled`) is off, or,
    with a warning saying why and what runs instead (`fallback`), where it cannot be built."""
    if not enabled:
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn(f"No C compiler (cc, gcc or $CC) found to build {source.name}: {fallback}")
        return None
    try:
        library = ctypes.CDLL(str(_build(source, compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        warnings.warn(f"Building {source.name} failed, {fallback}: {detail}")
        return None
    for name, argtypes in signatures.items():
        getattr(library, name).argtypes = argtypes
        getattr(library, name).restype = returns.get(name)
    return library
