"""Importing what a config value names: a Python file by its path, or a module by its dotted name."""

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType


def import_file_or_module(where: str, prefix: str) -> ModuleType:
    """The module at `where`: a file when it ends in `.py` or holds a `/` ("envs/my_reward.py"), else an
    importable module name ("my_package.rewards"); a file's module is named `prefix` + its stem (outside
    `sys.modules`). A missing file raises FileNotFoundError, a module that cannot be imported ImportError."""
    if where.endswith(".py") or "/" in where:
        file = Path(where).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"{file} does not exist")
        return import_file(file, prefix)
    return importlib.import_module(where)


def import_file(file: Path, prefix: str) -> ModuleType:
    """The module the Python file `file` defines, named `prefix` + the file's stem, outside `sys.modules`."""
    spec = importlib.util.spec_from_file_location(f"{prefix}{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
