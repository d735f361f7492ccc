"""Code rewards and their sandbox: right and wrong solutions, and solutions that hang, fork, write
outside their folder, allocate too much, open sockets, flood their output or signal the trainer.
Each hostile case is checked from outside (files, processes, a listening socket, a signal handler),
with the namespaces and with the in-process guard that stands in for them where `unshare` is refused."""

import asyncio
import json
import os
import signal
import socket
import threading

import pytest
import torch

from RL2.config import parse_config
from RL2.rewards import code_reward, parse_tests
from RL2.sandbox import CodeLimits, CodeTest, Sandbox, SandboxError, current_sandbox, use_sandbox
from RL2.sandbox.runner import default_concurrency, normalise_output
from tests.helpers.sandboxes import isolated_sandbox

LIMITS = CodeLimits(timeout_s=3.0, memory_mb=512, max_processes=8, max_file_mb=1, max_output_kb=64)
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return isolated_sandbox(LIMITS, "; the guard tests still run")


@pytest.fixture(scope="module")
def guarded() -> Sandbox:
    return Sandbox(LIMITS, max_concurrency=2, namespaces=False, allow_unisolated=True)


def run(sandbox: Sandbox, code: str, test: CodeTest | None = None):
    return sandbox.run_blocking(code, test or CodeTest(output=""))


def sandbox_processes(marker: str) -> list[int]:
    """Live processes whose command line mentions `marker` (a sandbox's working directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return found


def test_the_unisolated_guard_needs_an_opt_in():
    with pytest.raises(SandboxError, match=r"rollout\.code_sandbox_unisolated=true .*allow_unisolated=True"):
        Sandbox(LIMITS, namespaces=False).run_blocking("print('hi')", CodeTest(output="hi"))


def test_code_reward_uses_the_sandbox_of_its_run():
    solution, tests = "print(1)", {"tests": [{"output": "1"}]}
    refusing = Sandbox(LIMITS, max_concurrency=1, namespaces=False)  # the guard, not allowed: refuses every run
    guarded = Sandbox(LIMITS, max_concurrency=1, namespaces=False, allow_unisolated=True)
    with use_sandbox(refusing):
        with pytest.raises(SandboxError):
            asyncio.run(code_reward(solution, tests))
        with use_sandbox(guarded):
            assert current_sandbox() is guarded and asyncio.run(code_reward(solution, tests)) == 1.0
        assert current_sandbox() is refusing
        assert asyncio.run(code_reward(solution, tests, sandbox=guarded)) == 1.0  # one given to the call wins
    assert current_sandbox() not in (refusing, guarded) and current_sandbox() is current_sandbox()


CODE_ENV = """
from RL2.rewards import code_reward


async def step(state, action, extra_info):
    return {"reward": await code_reward("print(1)", {"tests": [{"output": "1"}]}), "done": True}
"""


def test_the_config_key_reaches_code_reward_in_each_run_s_rollout(one_rank, tiny_model_path, tok, tmp_path,
                                                                   monkeypatch):
    """Two runs of one process, one with rollout.code_sandbox_unisolated=true: the steps of each call code_reward
    on the environments' loop, and each run's calls go to a sandbox of its own setting, however their rollouts
    and constructions interleave."""
    from RL2.config.ppo_schema import PPOConfig
    from RL2.rollout.env import load_env
    from RL2.trainer.rollout_setup import rollout_worker

    isolated_sandbox(LIMITS)  # skips where solutions cannot be isolated: the run with false would stop
    (tmp_path / "env.py").write_text(CODE_ENV)
    ran_in, run_tests = [], Sandbox.run_tests

    async def recorded(self, *args, **kwargs):
        ran_in.append(self)
        return await run_tests(self, *args, **kwargs)

    monkeypatch.setattr(Sandbox, "run_tests", recorded)
    workers = {}
    for value in ("true", "false"):
        cfg = parse_config(PPOConfig, "ppo", [f"rollout.code_sandbox_unisolated={value}", "rollout.engine=embedded",
                                              f"actor.model_name={tiny_model_path}", "actor.dtype=float32"])
        workers[value] = rollout_worker(cfg.rollout, cfg.actor, tok, torch.device("cpu"), load_env(tmp_path / "env.py"),
                                        None)
    try:
        rewards = [workers[value].rollout([{"prompt": "Hi", "extra_info": {}}], {"max_new_tokens": 2}, 1, seed=0)
                   for value in ("true", "false", "true")]
    finally:
        for worker in workers.values():
            worker.engine.shutdown()
    assert [group[0].reward for [group] in rewards] == [1.0, 1.0, 1.0]
    assert [sandbox.allow_unisolated for sandbox in ran_in] == [True, False, True]
    assert ran_in[0] is ran_in[2] and ran_in[0] is not ran_in[1]  # a sandbox per run, kept from rollout to rollout
    assert not current_sandbox().allow_unisolated  # outside any run: the default


# ---- right and wrong ----


def test_right_wrong_and_partly_right_solutions(sandbox):
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4", "output": "6"}, {"input": "2 2", "output": "5"}]
    extra_info = {"tests": tests}
    right = f"Here:\n```python\n{ADD}```"
    assert asyncio.run(code_reward(right, extra_info)) == pytest.approx(2 / 3)  # the third test is wrong on purpose
    assert asyncio.run(code_reward(right, extra_info, all_or_nothing=True)) == 0.0
    assert asyncio.run(code_reward(right, {"tests": tests[:2]}, all_or_nothing=True)) == 1.0
    wrong = "a, b = map(int, input().split())\nprint(a - b)\n"
    assert asyncio.run(code_reward(wrong, extra_info)) == 0.0
    [result] = asyncio.run(sandbox.run_tests(wrong, parse_tests(tests[:1])))
    assert (result.status, result.stdout, result.isolation) == ("wrong_answer", "-1\n", "namespaces")


def test_assert_tests(sandbox):
    code = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(int(input()), 1))\n"
    tests = [{"assert": "assert add(1, 2) == 3"}, {"assert": "assert add('a', 'b') == 'ab'"},
             {"assert": "assert add(1, 1) == 3"}]
    assert asyncio.run(code_reward(code, {"tests": tests})) == pytest.approx(2 / 3)
    failed = run(sandbox, code, CodeTest(assert_code="assert add(1, 1) == 3"))
    assert failed.status == "error" and "AssertionError" in failed.stderr
    # Exiting before the test's end does not pass it, even with status 0.
    for cheat in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        assert run(sandbox, cheat, CodeTest(assert_code="assert False")).status == "error"
    # Nor does replacing what the grader calls, or reading the spec it was started with.
    cheats = ["import builtins\nbuiltins.exec = lambda *args, **kwargs: None\n",
              "import builtins\nbuiltins.compile = lambda *args, **kwargs: compile('pass', 'x', 'exec')\n",
              "import sys, os\nspec = sys._getframe(1).f_locals['spec']\n"
              "os.write(spec['result_fd'], (spec.get('token', '') + '\\n').encode())\nos._exit(0)\n"]
    for cheat in cheats:
        assert run(sandbox, cheat, CodeTest(assert_code="assert False")).status == "error", cheat


def test_exceptions_and_exit_codes(sandbox):
    assert run(sandbox, "print(1)\nraise ValueError('no')", CodeTest(output="1")).status == "error"
    assert run(sandbox, "print(1)\nimport sys\nsys.exit(0)", CodeTest(output="1")).status == "passed"
    assert run(sandbox, "print(1)\nimport sys\nsys.exit(3)", CodeTest(output="1")).status == "error"
    assert run(sandbox, "print(", CodeTest(output="")).status == "error"  # a syntax error
    big_input = "".join(f"{i}\n" for i in range(200_000))  # more than a pipe holds
    code = "import sys\nprint(sum(int(x) for x in sys.stdin))"
    assert run(sandbox, code, CodeTest(big_input, str(sum(range(200_000))))).status == "passed"


def test_parse_tests_schemas():
    stdio = parse_tests({"inputs": ["1\n", "2\n"], "outputs": ["a", "b"]})
    assert [(t.input, t.output) for t in stdio] == [("1\n", "a"), ("2\n", "b")]
    as_json = parse_tests(json.dumps([{"output": "x"}, {"assert": "assert True"}]))
    assert (as_json[0].input, as_json[0].output, as_json[1].assert_code) == ("", "x", "assert True")
    for bad, message in (([], "non-empty list"), ({"inputs": ["1"], "outputs": []}, "as many"),
                         ({"inputs": [[1]], "outputs": [2], "fn_name": "f"}, "fn_name"),
                         ([{"input": "1"}], r"tests'\]\[0\]"), ("{not json", "not JSON"), (None, "NoneType")):
        with pytest.raises(ValueError, match=message):
            parse_tests(bad)
    with pytest.raises(ValueError, match="extra_info\\['cases'\\]"):
        asyncio.run(code_reward("print(1)", {"tests": []}, tests_key="cases"))


def test_normalise_output():
    assert normalise_output("\n1 2  \n3\n\n") == "1 2\n3"
    assert normalise_output("1 2") != normalise_output("1  2")  # spaces inside a line count


# ---- hostile solutions ----


def test_infinite_loops_cost_their_own_reward(sandbox):
    for code in ("while True:\n    pass\n", "import time\ntime.sleep(60)\n"):
        result = run(sandbox, code)
        assert result.status == "timeout"
        assert result.seconds < LIMITS.timeout_s + 2  # killed at the limit, not waited for


def test_fork_bomb_is_bounded_and_cleaned_up(sandbox):
    # Children sleep in sessions of their own (out of the process group); the parent reports its forks.
    code = (
        "import os, time\nprint(os.getcwd(), flush=True)\nforks = 0\n"
        "try:\n"
        "    for _ in range(100):\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        forks += 1\n"
        "except OSError:\n"
        "    pass\n"
        "print(forks)\n"
    )
    result = run(sandbox, code)
    workdir, forks = result.stdout.split()
    assert int(forks) == LIMITS.max_processes - 1  # the solution's own process counts too
    assert sandbox_processes(os.path.basename(workdir)) == []  # none of them outlived the run


def test_fork_tree_is_bounded(sandbox):
    # Every process forks again: 2**6 processes without a limit. Each leaves a file named by its pid.
    code = (
        "import os, time\n"
        "for _ in range(6):\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        pass\n"
        "open(f'p{os.getpid()}', 'w').close()\n"
        "time.sleep(0.5)\n"
        "if os.getpid() == 2:\n"  # the solution's first process (2: after the namespace's first process)
        "    print(len([f for f in os.listdir('.') if f.startswith('p')]), os.getcwd(), flush=True)\n"
        "    os._exit(0)\n"
        "time.sleep(60)\n"
    )
    result = run(sandbox, code)
    count, workdir = result.stdout.split()
    assert int(count) == LIMITS.max_processes
    assert sandbox_processes(os.path.basename(workdir)) == []


@pytest.mark.parametrize("which", ["namespaces", "guard"])
def test_writes_outside_the_working_directory_do_not_land(sandbox, guarded, tmp_path, which):
    box = sandbox if which == "namespaces" else guarded
    targets = [tmp_path / "escape.txt", tmp_path / "made_dir"]
    code = (
        "import os\n"
        "open('inside.txt', 'w').write('x')\n"
        "print(os.getcwd(), open('inside.txt').read())\n"
        f"for attempt in (lambda: open({str(targets[0])!r}, 'w').write('x'), lambda: os.mkdir({str(targets[1])!r}),\n"
        f"                lambda: open('../escape_{tmp_path.name}.txt', 'w')):\n"
        "    try:\n"
        "        attempt()\n"
        "        print('escaped')\n"
        "    except OSError:\n"
        "        pass\n"
    )
    result = run(box, code)
    workdir, inside = result.stdout.split()
    assert inside == "x" and "escaped" not in result.stdout, result.stderr
    assert not any(target.exists() for target in targets)
    assert not os.path.exists(os.path.join(os.path.dirname(workdir), f"escape_{tmp_path.name}.txt"))
    assert not os.path.exists(workdir)  # the working directory was removed afterwards


def test_files_larger_than_the_limit_fail(sandbox):
    code = "with open('big', 'wb') as f:\n    f.write(b'x' * (2 * 2**20))\nprint('wrote')"
    result = run(sandbox, code, CodeTest(output="wrote"))
    assert result.status == "error" and "wrote" not in result.stdout


def test_huge_allocation_fails_the_solution_only(sandbox):
    result = run(sandbox, "x = bytearray(64 * 2**30)\nprint('allocated')", CodeTest(output="allocated"))
    assert result.status == "error" and "MemoryError" in result.stderr
    fits = run(sandbox, "x = bytearray(100 * 2**20)\nprint(len(x))", CodeTest(output=str(100 * 2**20)))
    assert fits.status == "passed"  # the limit is not below what a solution needs


@pytest.mark.parametrize("which", ["namespaces", "guard"])
def test_no_network(sandbox, guarded, which):
    box = sandbox if which == "namespaces" else guarded
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except TimeoutError:
            pass

    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('refused', type(e).__name__)\n"
    )
    try:
        result = run(box, code)
        accept()
    finally:
        server.close()
    assert result.stdout.startswith("refused") and not accepted, result.stdout + result.stderr


@pytest.mark.parametrize("which", ["namespaces", "guard"])
def test_cannot_signal_the_trainer(sandbox, guarded, which):
    box = sandbox if which == "namespaces" else guarded
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: received.append(True))
    code = f"import os, signal\ntry:\n    os.kill({os.getpid()}, signal.SIGUSR1)\nexcept OSError:\n    pass\n"
    try:
        run(box, code)
        signal.sigtimedwait([], 0.2) if hasattr(signal, "sigtimedwait") else None
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == []


def test_trainer_environment_does_not_leak(sandbox, monkeypatch):
    monkeypatch.setenv("RL2_TEST_SECRET", "hunter2")
    result = run(sandbox, "import os\nprint(os.environ.get('RL2_TEST_SECRET'))", CodeTest(output="None"))
    assert result.status == "passed", result.stdout


def test_output_flood_is_cut(sandbox):
    result = run(sandbox, "while True:\n    print('x' * 1000)\n")
    assert result.status == "output_limit" and len(result.stdout) == LIMITS.max_output_kb * 1024


# ---- async use ----


def test_default_concurrency_shares_the_cores_among_local_ranks(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_concurrency() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert default_concurrency() == 1


def test_runs_off_the_event_loop_within_the_concurrency_bound(sandbox, monkeypatch):
    running, most = 0, 0
    lock = threading.Lock()
    real = Sandbox.run_blocking

    def counting(self, code, test):  # a recording wrapper around the real run
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            return real(self, code, test)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(Sandbox, "run_blocking", counting)

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        results = await asyncio.gather(*(sandbox.run("import time\ntime.sleep(0.5)\nprint('ok')", CodeTest(output="ok"))
                                         for _ in range(5)))
        ticker.cancel()
        return results, ticks

    results, ticks = asyncio.run(main())
    assert all(r.passed for r in results)
    assert most == sandbox.max_concurrency == 2
    assert ticks > 10  # the loop kept running while solutions slept


def test_ipc_objects_do_not_outlive_the_run(sandbox):
    # A System V shared memory segment and a POSIX message queue made by one run: neither is in the
    # trainer's IPC namespace afterwards, nor in the next run's. The host side removes any it finds.
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    key, queue = 0x5EED5EED, b"/rl2-sandbox-test"
    make = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.shmget({key}, 4096, 0o1666) >= 0, libc.mq_open({queue!r}, 0o102, 0o666, None) >= 0)\n")
    look = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"print(libc.shmget({key}, 0, 0) >= 0, libc.mq_open({queue!r}, 0) >= 0, "
            "open('/proc/sys/kernel/hostname').read())\n")
    try:
        assert run(sandbox, make).stdout.split() == ["True", "True"]
        shm_id, mq = libc.shmget(key, 0, 0), libc.mq_open(queue, 0)
        assert (shm_id, mq) == (-1, -1), "the run's IPC objects are in the trainer's namespace"
        seen = run(sandbox, look).stdout.split()
        assert seen[:2] == ["False", "False"] and seen[2] != socket.gethostname(), seen
    finally:
        if (shm_id := libc.shmget(key, 0, 0)) >= 0:
            libc.shmctl(shm_id, 0, None)  # IPC_RMID
        libc.mq_unlink(queue)


def test_the_trainers_files_are_out_of_sight(sandbox):
    # Training data, checkpoints and caches lie where the trainer keeps them (here: the repository this
    # test is in, world-readable); the sandbox's root shows the system's folders and Python only.
    import sys
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve()
    code = (f"import os, decimal\nprint(os.path.exists({str(here)!r}), os.path.exists({str(here.parents[2])!r}))\n"
            "print(*sorted(os.listdir('/')))\n")
    seen = run(sandbox, code).stdout.splitlines()
    assert seen[0].split() == ["False", "False"], seen
    system = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc"}
    python = {Path(folder).resolve().parts[1] for folder in (sys.prefix, sys.base_prefix, tempfile.gettempdir())}
    assert set(seen[1].split()) <= system | python, seen
