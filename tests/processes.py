"""Running multi-process launchers from tests: a free rendezvous port, and a run that leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    """A TCP port free on this machine now, so two suites running at once never share a rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dump_worker_stacks(launcher_pid: int) -> None:
    """SIGABRT to every process under ``launcher_pid`` but the launcher: each Python worker started with
    ``PYTHONFAULTHANDLER=1`` writes its threads' stacks to its stderr before it dies."""
    import psutil  # accelerate's own dependency

    try:
        workers = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for worker in workers:
        try:
            worker.send_signal(signal.SIGABRT)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(workers, timeout=10)


PORT_FLAGS = ("--master_port", "--main_process_port")
"""The launchers' rendezvous-port flags (``torch.distributed.run``, ``accelerate launch``)."""


def run_launcher(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 480) -> subprocess.CompletedProcess:
    """:func:`run_launcher_once`, again on a fresh rendezvous port (at most twice more) when the port
    :func:`free_port` found was taken by another process before the launcher bound it (tests run in parallel, and
    other suites may run beside them)."""
    for attempt in range(3):
        try:
            return run_launcher_once(cmd, cwd, env, timeout)
        except AssertionError as error:
            flag = next((i for i, arg in enumerate(cmd) if arg in PORT_FLAGS), None)
            if attempt == 2 or flag is None or "address already in use" not in str(error).lower():
                raise
            cmd = [*cmd[: flag + 1], str(free_port()), *cmd[flag + 2:]]
    raise AssertionError("unreachable")


def run_launcher_once(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 480
                      ) -> subprocess.CompletedProcess:
    """Run a launcher command (``accelerate launch``, ``torch.distributed.run``) to the end; asserts it succeeded
    (an ``AssertionError`` with the tail of its stderr when it failed or ran past ``timeout`` seconds).

    On a timeout every worker still running first gets SIGABRT, on which Python's faulthandler (switched on here
    through ``PYTHONFAULTHANDLER``) writes each of its threads' stacks to stderr: the message says where it hung.
    Then the launcher gets SIGTERM, which it passes on to its workers (they run in sessions of their own, out of
    reach of a kill of the launcher's group), then its group gets SIGKILL: nothing is left running.
    """
    proc = subprocess.Popen(cmd, cwd=cwd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        dump_worker_stacks(proc.pid)
        proc.terminate()
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate(timeout=60)
        raise AssertionError(f"{' '.join(map(str, cmd[:4]))} ... ran past {timeout:.0f} s (a loaded machine?); "
                             f"its stderr ends:\n{(stderr or '')[-12000:]}") from None
    assert proc.returncode == 0, stderr[-4000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
