"""Elastic workers of the parameter server: a worker process killed with SIGKILL and started
again as the same task rejoins at the clock its pushes reached (asp and ssp), while the
shards keep serving the other worker."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .conftest import free_ports

# An example or a program, which the choice of hot paths does not change: scripts/test
# runs these in its compiled leg only.
pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parent.parent
STEPS = 400


class Proc:
    """A child process whose stdout and stderr lines are collected by a thread."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "examples.param_server", *argv], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, within: float) -> re.Match[str]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for line in list(self.lines):
                found = re.search(pattern, line)
                if found:
                    return found
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"never printed {pattern!r}: {''.join(self.lines)[-3000:]}")

    def finish(self, within: float) -> str:
        self.proc.wait(timeout=within)
        self.reader.join(5)
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def alternatives_from(low: int) -> str:
    """A regex alternation of every step number from ``low`` to the last."""
    return "|".join(str(n) for n in range(STEPS, low - 1, -1))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("consistency", "mode"), [("ssp", "recv"), ("asp", "recv"), ("ssp", "send")])
def test_a_killed_worker_restarted_as_the_same_task_rejoins_and_the_run_completes(
        consistency: str, mode: str) -> None:
    ports = free_ports(4)
    cluster = json.dumps({"ps": [f"127.0.0.1:{p}" for p in ports[:2]],
                          "worker": [f"127.0.0.1:{p}" for p in ports[2:]]})
    common = ["--cluster", cluster, "--consistency", consistency, "--staleness", "2", "--dim", "4",
              "--worker-rejoin", "30", "--log-level", "INFO", "--mode", mode]
    work = ["--steps", str(STEPS), "--batch", "64", "--vocab", "500", "--progress-every", "0.05"]
    procs: list[Proc] = []
    try:
        shards = [Proc(["serve", "--task", str(s), "--job", "ps", *common]) for s in range(2)]
        workers = [Proc(["train", "--job", "worker", "--task", str(w), *common, *work]) for w in range(2)]
        procs += shards + workers
        # Mid-run: worker 1 has pushed some steps (a progress line), then it is killed.
        step = int(workers[1].wait_for(r"worker 1: step (\d+) of", 30)[1])
        workers[1].proc.send_signal(signal.SIGKILL)
        workers[1].proc.wait(10)
        assert step < STEPS
        dead = max(int(shard.wait_for(r"waiting up to 30 s for a new process of worker 1 \(its pushes "
                                      r"stand at clock (\d+)", 10)[1]) for shard in shards)
        # Meanwhile the other worker goes on: its step ``dead + 4`` pulled at ``dead + 3``,
        # which the staleness bound of 2 would hold back while the dead worker counted.
        later = alternatives_from(dead + 4)
        workers[0].wait_for(rf"worker 0: steps 0 to {STEPS}|worker 0: step ({later}) of", 30)
        again = Proc(["train", "--job", "worker", "--task", "1", *common, *work])
        procs.append(again)
        outs = [p.finish(60) for p in (*shards, workers[0], again)]
        assert [p.proc.returncode for p in (*shards, workers[0], again)] == [0] * 4, outs
        # The new process went on where the shards said the killed one got, not from 0.
        first = int(re.search(r"worker 1: steps (\d+) to 400", outs[3])[1])  # type: ignore[index]
        assert step <= first < STEPS, outs[3]
        assert "worker 0: steps 0 to 400" in outs[2]
        for s, out in enumerate(outs[:2]):
            # Both workers' steps are accounted: every push of both to its last clock, at most
            # one push lost in flight with the killed process.
            assert f"ps {s}: 1 workers lost; worker clocks [{STEPS}, {STEPS}], processes per worker [1, 2]" \
                in out, out
            pushes = int(re.search(rf"ps {s}: served \d+ pulls \(\d+ ids\), (\d+) pushes", out)[1])  # type: ignore[index]
            assert 2 * STEPS - 1 <= pushes <= 2 * STEPS, out
    finally:
        for p in procs:
            p.kill()


def test_worker_rejoin_is_refused_under_bsp() -> None:
    out = subprocess.run([sys.executable, "-m", "examples.param_server", "demo", "--consistency", "bsp",
                          "--worker-rejoin", "5"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--worker-rejoin needs --consistency asp or ssp" in out.stderr
