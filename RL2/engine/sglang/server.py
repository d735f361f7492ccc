"""One SGLang server process, `python -m sglang.launch_server ...` run by the trainer's Python or another one: its
command line, launch, readiness, log and shutdown. Its API key goes in a file only this user can read, never on its
command line (docs/gpus.md, "SGLang servers")."""

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from RL2.config.errors import ConfigError
from RL2.engine.protocol import EngineError
from RL2.engine.sglang.http_client import control_request
from RL2.parallel import free_port

# Environment variables of torchrun that would make the server think it is a rank of the trainer.
TRAINER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# SGLang's load-snapshot file in /dev/shm: its processes close it at exit but never unlink it (SGLang
# sweeps such files only in its own CI), so every launch would leave one behind.
SGLANG_SHM_PREFIX = "/dev/shm/sglang_loads_"


def server_command(python: str, model_path: str, port: int, server_args: dict) -> list[str]:
    """The command line of one server: `python -m sglang.launch_server --model-path ... --port ...`."""
    command = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--port", str(port)]
    for name, value in server_args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            command.append(flag)
        elif value is not False:
            command += [flag, *map(str, value if isinstance(value, list) else [value])]
    return command


def resolve_python(python: str) -> str:
    """The absolute path of the interpreter `python` names (a path, or a command on PATH such as `python3`). The
    server's process re-executes it with `os.execv` (see `_EXEC_DYING_WITH_PARENT`), which takes a path and does not
    search PATH as `subprocess.Popen` does: a bare name would start the wrapper and then fail at its exec."""
    found = shutil.which(str(python))
    if found is None:
        raise ConfigError(f"config key 'rollout.server_python' is {python!r}, which is neither an executable file nor "
                          f"a command on PATH; give the path of the Python that has sglang, "
                          f"e.g. ~/sglang-venv/bin/python")
    return os.path.abspath(found)


class SGLangServer:
    """A launched `sglang.launch_server` process run by `python`, its output in `log_dir` (None: a temporary folder)."""

    def __init__(self, python: str, model_path: str, server_args: dict, env: dict | None = None,
                 log_dir: str | None = None):
        host = str(server_args.get("host", "127.0.0.1"))
        connect_host = "127.0.0.1" if host == "0.0.0.0" else host
        self.port = free_port(connect_host)
        self.url = f"http://{connect_host}:{self.port}"
        server_args, self.key_file = _key_in_file(server_args)
        self.command = server_command(resolve_python(python), model_path, self.port, {"host": host} | server_args)
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="rl2-sglang-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"sglang-{self.port}.log"
        self.process: subprocess.Popen | None = None
        self._env = {key: value for key, value in os.environ.items()
                     if key not in TRAINER_ENV and not key.startswith("TORCHELASTIC_")}
        self._env |= {"RL2_TRAINER_PID": str(os.getpid())} | {str(k): str(v) for k, v in (env or {}).items()}
        self.shm_files: set[str] = set()  # SGLang's files in /dev/shm that this server's processes mapped

    def start(self) -> "SGLangServer":
        with open(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as log:
            log.write(" ".join(self.command) + "\n")
            log.flush()
            # Its own process group, so that shutdown reaches SGLang's scheduler and detokenizer processes too; and it
            # dies with this process even when this one is killed.
            self.process = subprocess.Popen(
                [self.command[0], "-c", _EXEC_DYING_WITH_PARENT, *self.command], stdout=log,
                stderr=subprocess.STDOUT, env=self._env, start_new_session=True,
            )
        atexit.register(self.shutdown)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Poll `/health` until the server answers 200; EngineError with its log tail if it exits first
        or is not ready within `timeout` seconds (then it is shut down)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineError(f"the SGLang server exited with code {self.process.returncode} before it was "
                                  f"ready.\n{self.describe()}")
            try:
                control_request(self.url, "/health", timeout=5.0)
            except EngineError:  # not listening or not ready yet
                time.sleep(1.0)
                continue
            self.shm_files |= sglang_shm_files(self.process.pid)
            self._remove_key_file()  # read at its start
            return
        self.shutdown()
        raise EngineError(f"the SGLang server was not ready within {timeout:.0f} s (rollout.server_timeout).\n"
                          f"{self.describe()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def describe(self) -> str:
        """The command and the last lines of the log, for error messages."""
        try:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
        except OSError:
            tail = "(no log)"
        return f"command: {' '.join(self.command)}\nlog {self.log_path} ends with:\n{tail}"

    def shutdown(self) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after 10 s; remove SGLang's files in /dev/shm."""
        self._remove_key_file()
        if self.process is None:
            return
        if self.process.poll() is None or _group_alive(self.process.pid):
            self.shm_files |= sglang_shm_files(self.process.pid)
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
                if not _group_alive(self.process.pid):
                    break
        for path in self.shm_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _remove_key_file(self) -> None:
        if self.key_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.key_file)


def _key_in_file(server_args: dict) -> tuple[dict, str | None]:
    """(`server_args` for the command line, the file or None): `api_key`, and any `config` of the user's merged in,
    moved to a new `--config` file only this user can read (SGLang's YAML file of flags, read by
    `sglang.srt.server_args.prepare_server_args` in 0.5.x). SGLang logs its arguments: the log is this user's too."""
    if server_args.get("api_key") is None:
        return server_args, None
    args = dict(server_args)
    flags = {}
    if args.get("config") is not None:  # SGLang takes one --config: the user's flags go into ours
        import yaml  # omegaconf's dependency

        with open(args.pop("config")) as f:
            flags = yaml.safe_load(f) or {}
    flags = {key: value for key, value in flags.items() if str(key).replace("_", "-") != "api-key"}
    flags["api-key"] = str(args.pop("api_key"))  # SGLang passes a key on as "--<key>": the flag's own spelling
    fd, path = tempfile.mkstemp(prefix="rl2-sglang-", suffix=".yaml")  # mode 0600
    with os.fdopen(fd, "w") as f:
        json.dump(flags, f)  # JSON is YAML, with every string quoted
    return args | {"config": path}, path


def sglang_shm_files(pgid: int) -> set[str]:
    """SGLang's files in /dev/shm that a process of group `pgid` has mapped (Linux; empty elsewhere)."""
    found = set()
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            if os.getpgid(pid) != pgid:
                continue
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(SGLANG_SHM_PREFIX):
                        found.add(fields[5].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, under another user
        pass
    return True


# Run as `python -c` before the server: Linux SIGTERMs the process when its parent (the trainer) dies,
# even by SIGKILL, and the setting survives exec. Done in the child's own Python rather than in a
# preexec_fn, which is unsafe in a multithreaded parent. A parent already gone by then means exit.
_EXEC_DYING_WITH_PARENT = """
import ctypes, os, signal, sys
parent = int(os.environ["RL2_TRAINER_PID"])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass  # not Linux: the trainer's shutdown at exit still stops the server
if os.getppid() != parent:
    sys.exit("the trainer process is gone")
os.execv(sys.argv[1], sys.argv[1:])
"""
