"""A command's imports run with the cyclic garbage collector off, and its entry point turns it back on."""

import gc
import os
import subprocess
import sys

import pytest

from RL2.utils import startup_gc
from RL2.utils.startup_gc import command_ends, imports_done, module_run, off_while_a_command_imports


@pytest.mark.parametrize("argv, module", [
    (["python", "-m", "RL2.trainer.ppo", "actor.lr=1e-6"], "RL2.trainer.ppo"),
    (["python", "-u", "-m", "RL2.trainer.sft"], "RL2.trainer.sft"),  # how torchrun starts each rank
    (["python", "-X", "importtime", "-mRL2.evaluate"], "RL2.evaluate"),
    (["python", "-W", "ignore", "-m", "pytest", "-m", "slow"], "pytest"),
    (["python", "--check-hash-based-pycs", "never", "-m", "RL2.trainer.dpo"], "RL2.trainer.dpo"),
    (["python", "train.py", "-m", "RL2.trainer.ppo"], None),  # a script's own arguments
    (["python", "-c", "import RL2", "-m", "RL2.trainer.ppo"], None),
    (["python", "-m"], None),
    (["python"], None),
])
def test_the_module_a_command_line_runs(argv, module):
    assert module_run(argv) == module


@pytest.fixture
def collector_restored():
    yield
    gc.enable()
    gc.unfreeze()
    startup_gc._command = False


@pytest.mark.parametrize("module, turned_off", [("RL2.trainer.ppo", True), ("RL2.evaluate", True),
                                                ("RL2.viewer", False), ("mypackage.train", False)])
def test_off_only_while_an_rl2_command_is_imported(monkeypatch, collector_restored, module, turned_off):
    monkeypatch.setattr(sys, "orig_argv", ["python", "-u", "-m", module])
    monkeypatch.setattr(sys, "argv", ["-m"])  # Python's argv[0] while it finds the module of `-m`
    off_while_a_command_imports()
    assert gc.isenabled() is not turned_off
    imports_done()
    assert gc.isenabled()
    assert (gc.get_freeze_count() > 0) is turned_off
    gc.unfreeze()
    command_ends()  # a command's end freezes what is left; a program's objects stay in the collector's care
    assert (gc.get_freeze_count() > 0) is turned_off


def test_a_program_importing_rl2_keeps_its_collector(monkeypatch, collector_restored):
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "RL2.trainer.ppo"])
    monkeypatch.setattr(sys, "argv", ["/path/RL2/trainer/ppo.py"])  # the module found: its own code runs now
    off_while_a_command_imports()
    assert gc.isenabled()
    gc.disable()  # a program's own choice, which `imports_done` leaves alone
    imports_done()
    assert not gc.isenabled()


# Printed at the interpreter's exit, after the command's entry point has run (`sitecustomize` loads before it).
_REPORT = ("import atexit, gc\n"
           "atexit.register(lambda: print('collector', gc.isenabled(), gc.get_freeze_count() > 0, flush=True))\n")


@pytest.mark.parametrize("command, frozen", [
    (["-m", "RL2.trainer.sft", "--help"], True),
    (["-m", "RL2.evaluate", "--help"], True),
    (["-c", "import RL2.trainer.sft"], False),
])
def test_a_command_runs_with_the_collector_on(tmp_path, command, frozen):
    (tmp_path / "sitecustomize.py").write_text(_REPORT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == f"collector True {frozen}"
