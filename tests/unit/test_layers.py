"""The README's layer order holds: every module of RL2/ sits on a row of its Layout, and imports only from its own
row or the rows above, lazy imports (inside functions), TYPE_CHECKING imports and `importlib.import_module` of a
written-out name included."""

import ast
from pathlib import Path

from tests.helpers import REPO


def layout_rows(readme: str) -> list[str]:
    """The Layout's RL2 rows, bottom layer first, as module prefixes (`RL2.config`, `RL2.batch`)."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    paths = [line.split()[0] for line in block.splitlines() if line.startswith("RL2/")]
    return [path.removesuffix("/").removesuffix(".py").replace("/", ".") for path in paths]


def row_of(module: str, rows: list[str]) -> int | None:
    """The row of a module (`RL2.rollout.loop` is on `RL2.rollout`'s), or None when it is on none."""
    for index, prefix in enumerate(rows):
        if module == prefix or module.startswith(prefix + "."):
            return index
    return None


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every import of an RL2 module anywhere in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of `module`
                parts = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            # `from RL2 import api` and `from RL2.rollout import loop` import modules by their names.
            found += [(node.lineno, f"{base}.{alias.name}" if base in ("RL2",) else base) for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return [(line, name) for line, name in found if name == "RL2" or name.startswith("RL2.")]


def layer_violations(package: Path, rows: list[str]) -> list[str]:
    """Each module not on a row, and each import of a module on a row below the importer's (nearer the top)."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package.parent).with_suffix("")
        is_package = relative.name == "__init__"
        module = ".".join(relative.parts[:-1] if is_package else relative.parts)
        if module == "RL2":  # the package's front door: `RL2.train`, `RL2.evaluate`, lazily
            continue
        own = row_of(module, rows)
        if own is None:
            problems.append(f"{relative}.py is on no row of README.md's Layout: add it where its imports put it")
            continue
        for line, name in imported_modules(ast.parse(path.read_text()), module, is_package):
            other = row_of(name, rows)
            if name != "RL2" and (other is None or other > own):
                problems.append(f"{relative}.py:{line} imports {name}, on a row below {rows[own]}'s")
    return problems


def test_every_module_imports_only_from_its_row_or_the_rows_above():
    rows = layout_rows((REPO / "README.md").read_text())
    assert rows[0] == "RL2.versions" and "RL2.config" in rows and "RL2.api" in rows
    assert layer_violations(REPO / "RL2", rows) == []


def test_the_check_finds_lazy_type_checking_and_importlib_imports_and_modules_off_the_layout(tmp_path):
    """The check itself, on a made-up package: each kind of upward import is found, and a module on no row."""
    package = tmp_path / "RL2"
    for name, text in {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from RL2.high.b import B\n"
                     "def f():\n    from RL2.high import b\n    import importlib\n"
                     "    return importlib.import_module('RL2.high.b')\n"),
        "low/c.py": "from . import a\nfrom .a import f\nimport RL2.low.a\n",  # its own row: fine
        "high/__init__.py": "",
        "high/b.py": "from RL2.low.a import f\nfrom ..low import c\n",  # rows above: fine
        "stray.py": "",
    }.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    problems = layer_violations(package, ["RL2.low", "RL2.high"])
    assert [p.split(" imports RL2")[0] for p in problems] == [
        "RL2/low/a.py:3", "RL2/low/a.py:5", "RL2/low/a.py:7",
        "RL2/stray.py is on no row of README.md's Layout: add it where its imports put it"]
