"""Test peers in their own processes: started, waited for, and always killed and reaped."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import rvz


@contextmanager
def ready_process(argv: list[str], cwd: str | None = None,
                  stdin: Any = subprocess.PIPE) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv``, which prints ``ready <implementation>`` once it serves; yields the
    process, then resumes it (if stopped), kills and reaps it on the way out."""
    proc = subprocess.Popen(argv, cwd=cwd, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        line = proc.stdout.readline().decode() if ready else ""
        if not line.startswith("ready"):
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"peer process did not start: {line!r} {err.decode()[-2000:]}")
        words = line.split()
        if len(words) > 1:  # the child runs the same hot paths
            assert words[1] == rvz.implementation(), line
        yield proc
    finally:
        try:
            proc.send_signal(signal.SIGCONT)  # resume a stopped peer, then kill it
        except ProcessLookupError:
            pass
        proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def run_module(module: str, *args: str, cwd: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` in ``cwd`` (on ``PYTHONPATH``), in its own process group,
    which is killed whatever happens: with every process it started, should it be killed
    itself."""
    return run_python(["-m", module, *args], cwd=cwd, timeout=timeout)


def run_python(args: list[str], cwd: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python args``, as ``run_module`` runs a module (``-c`` code, for instance)."""
    env = dict(os.environ, PYTHONPATH=cwd)
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
