"""Importing what a config value names: a Python file by its path, or a module by its dotted name."""

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType


def import_file_or_module(where: str, prefix: str) -> ModuleType:
    """The module at `where`: a file when it ends in `.py` or holds a `/`, else an importable module name.

    Args:
        where: e.g. "envs/my_reward.py" or "my_package.rewards".
        prefix: the name a file's module gets, before the file's stem (files never enter `sys.modules`).

    Raises:
        FileNotFoundError: a file that is not there.
        ImportError: a module that cannot be imported.
    """
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
