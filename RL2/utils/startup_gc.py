"""Python's cyclic garbage collector while an RL2 command starts. `python -m RL2.trainer.<name>` (each rank under
torchrun) and `python -m RL2.evaluate` import torch and transformers: some 700,000 objects that live as long
as the process, which every full pass of the collector walks again while they load, a quarter of the imports' time.
Such a command imports with the collector off; its entry point calls `imports_done`, which turns it back on with what
was imported frozen out of its passes (`RL2.parallel.close_process_groups` collects what the run made alone), and
at its end `command_ends` freezes all that is left, for the interpreter's exit. Only the standard library here:
RL2's `__init__` calls this first."""

import gc
import sys

COMMANDS = ("RL2.trainer.", "RL2.evaluate")
# Options whose value is the next word: `python -X importtime -m RL2.trainer.ppo`.
_OPTIONS_WITH_A_VALUE = ("-X", "-W", "--check-hash-based-pycs")

_command = False  # this process is an RL2 command (its collector was off while it imported)


def module_run(argv: list[str]) -> str | None:
    """The module a Python command line (`sys.orig_argv`) runs with `-m`; None for a script, `-c` or none."""
    words = iter(argv[1:])
    for word in words:
        if word == "-m":
            return next(words, None)
        if word.startswith("-m"):
            return word[2:]
        if word in _OPTIONS_WITH_A_VALUE:
            next(words, None)
        elif word == "-c" or not word.startswith("-"):
            return None  # the options end at a command or a script
    return None


def off_while_a_command_imports() -> None:
    """Turn the collector off when this process is an RL2 command whose module Python is still importing (while
    `-m` finds it, `sys.argv[0]` is "-m"); a script or a program that imports RL2 keeps it as it is."""
    global _command
    running = module_run(getattr(sys, "orig_argv", []))
    if sys.argv[:1] == ["-m"] and running is not None and running.startswith(COMMANDS) and gc.isenabled():
        gc.disable()
        _command = True


def imports_done() -> None:
    """At a command's entry point: the collector back on where it was turned off, the objects so far out of its
    passes (they live as long as the process; the little import garbage among them stays, too)."""
    if _command and not gc.isenabled():
        gc.freeze()
        gc.enable()


def command_ends() -> None:
    """At the end of a command's entry point, its process groups closed: everything left frozen, as the process
    exits. The interpreter's exit collects again and again, walking every object (a trainer's second); frozen, it
    walks none. Python promises no finalizer to an object alive at exit anyway; atexit handlers (weakref finalizers
    among them) still run."""
    if _command:
        gc.freeze()
