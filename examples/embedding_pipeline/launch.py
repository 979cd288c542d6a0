"""Processes of one training run: PS shards and N workers, each in its own process.

``run_job(spec)`` starts fresh PS shard processes (``run_shard`` of the parameter server,
``bsp`` consistency) and ``spec.workers`` worker processes (``spawn``: fresh interpreters),
waits for all of them within ``spec.timeout`` and returns worker 0's result. Whatever
happens, no child outlives the call. If a worker fails or dies, the others' reports (each
names the step that was aborted) and every exit code are gathered into one ``JobFailed``.
With ``train.worker_rejoin``, a worker killed by a signal is started again as its task
(``restarts`` times at most per task): it replays from its journal (trainer.py, rejoin.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import queue
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rvz

from ..common import LOCAL_HOST, child_signals, starting_child
from ..param_server import cut
from ..param_server.client import PSClient
from ..param_server.cut import load_worker_part
from ..param_server.launch import PSConfig, run_shard
from ..param_server.launch import local_cluster as ps_cluster
from ..param_server.protocol import WORKER_JOB
from .criteo import Columns
from .rejoin import Peers, clear_journal, newest_part
from .trainer import HeldOut, TrainConfig, Worker, WorkerCut

log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """A run failed: the message gathers every process's report."""


@dataclass(frozen=True)
class JobSpec:
    train_dir: str
    eval_dir: str | None
    train: TrainConfig
    ps: PSConfig
    shards: int = 2
    timeout: float = 600.0
    node_options: dict[str, Any] = field(default_factory=dict)
    kill_worker: tuple[int, int] | None = None   # (worker, step): that worker kills itself (tests, demo)
    kill_shard: tuple[int, int] | None = None    # (shard, step): that shard kills itself once step is applied
    switch_interval: float = 0.0005              # seconds, in the worker processes (see worker_process)
    host: str = LOCAL_HOST                       # where run_job's processes listen
    crash_job_at: int | None = None              # worker 0 SIGKILLs the job at this step (a demo)
    restarts: int = 1                            # with train.worker_rejoin: restarts of a killed worker

    @property
    def workers(self) -> int:
        return self.train.num_workers


def local_cluster(shards: int, workers: int, host: str = LOCAL_HOST) -> dict[str, list[str]]:
    return ps_cluster(shards, workers, WORKER_JOB, host)


def ps_config(base: PSConfig, workers: int, worker_rejoin: float = 0.0) -> PSConfig:
    """The PS settings a pipeline run needs: bsp (deterministic, worker-ordered updates)."""
    return PSConfig(**{**base.__dict__, "num_workers": workers, "consistency": "bsp", "staleness": 0,
                       "worker_rejoin": worker_rejoin})


async def train_worker(cluster: dict[str, list[str]], w: int, spec: JobSpec) -> dict[str, Any]:
    """Worker ``w``'s whole life: its node, its PS client, its EG and MG."""
    data = Columns.open(spec.train_dir)
    held_out = None
    if w == 0 and spec.eval_dir is not None:
        ev = Columns.open(spec.eval_dir)
        held_out = HeldOut(ev.rows(0, len(ev)))
    error: BaseException | None = None
    result = None
    # Leave the node's ``async with`` normally even on failure: a graceful close delivers
    # the step clean-up and END messages to the others before the connections go.
    # Dialling a peer that is not up (yet) is bounded by --timeout too.
    options = {"connect_timeout": min(10.0, spec.train.timeout), **spec.node_options,
               **spec.ps.node_kwargs()}
    async with rvz.Node(cluster, WORKER_JOB, w, mode=spec.ps.mode, **options) as node:
        # The run's shards are never restarted: a lost one fails the step at once instead of
        # being waited for.
        rejoin = spec.train.worker_rejoin > 0 and spec.train.journal is not None
        ps = PSClient(node, spec.shards, spec.ps.dim, timeout=spec.train.timeout, restart_timeout=0,
                      replay=rejoin)
        peers = None
        try:
            resume = None
            if spec.ps.resume_cut is not None:
                arrays, meta = load_worker_part(Path(spec.ps.resume_cut), w)
                resume = WorkerCut(spec.ps.start_clock, arrays, meta)
            if rejoin:
                resume, peers = await rejoin_or_start(node, ps, spec, resume)
            worker = Worker(node, ps, data, spec.train, held_out, resume=resume, peers=peers)
            if spec.kill_worker is not None and spec.kill_worker[0] == w:
                arm_kill(worker, spec.kill_worker[1])
            if spec.crash_job_at is not None and w == 0:
                arm_job_kill(worker, spec)
            result = await worker.run()
        except Exception as exc:  # reported below, once the node is closed
            error = exc
        if peers is not None:
            await peers.stop()
        try:
            await asyncio.wait_for(ps.close(), spec.train.timeout)
        except (rvz.RvzError, TimeoutError, asyncio.TimeoutError) as exc:  # (two classes before 3.11)
            # After a failure, a lost shard fails the close too: that is a consequence, and
            # the failure that names the step stays the error reported.
            if error is None:
                error = exc
            else:
                add_note(error, f"closing the PS client also failed: {type(exc).__name__}: {exc}")
    if error is not None:
        raise error
    assert result is not None
    return result.to_dict()


async def rejoin_or_start(node: rvz.Node, ps: PSClient, spec: JobSpec,
                          resume: WorkerCut | None) -> tuple[WorkerCut | None, Peers]:
    """With ``worker_rejoin``: the shards' greetings say whether this process replaces a lost
    one of its task. If so, it replays from the newest part of its journal (or from step 0
    if it has none): it tells the shards and the other workers where; if not, it clears
    what an earlier job left in its journal."""
    cfg = spec.train
    assert cfg.journal is not None
    w = node.task
    await ps.connect()
    generation = max(ps.generation)
    peers = Peers(node, spec.workers, worker_rejoin=cfg.worker_rejoin, timeout=cfg.timeout,
                  generation=generation, keep=cfg.staleness + 3)
    if not ps.restarted:
        clear_journal(cfg.journal, w)
        peers.start()
        return resume, peers
    part = newest_part(cfg.journal, w)
    if part is not None:
        clock, arrays, meta = part
        resume = WorkerCut(clock, arrays, meta)
    first = resume.clock if resume is not None else 0
    log.warning("worker %d: a restarted process (generation %d); replaying from step %d (its journal's "
                "newest part)", w, generation, first)
    await ps.join_at(first)
    await peers.announce(first)
    peers.start()
    return resume, peers


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (PEP 678), also before Python 3.11."""
    exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" + "".join(f" ({n})" for n in getattr(exc, "__notes__", []))


def arm_kill(worker: Worker, step: int) -> None:
    """Make this process die by SIGKILL when MG starts ``step`` (a crash, not an error)."""
    import os

    original = worker.model.forward_backward

    def forward_backward(*args: Any) -> Any:
        if worker.model.steps == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args)

    worker.model.forward_backward = forward_backward  # type: ignore[method-assign]


def arm_job_kill(worker: Worker, spec: JobSpec) -> None:
    """Make worker 0 kill every process of the job (SIGKILL to its process group: the
    launcher, the shards, the workers) when MG starts ``spec.crash_job_at``, once the last
    whole-job cut before that step is complete (so that there is one to resume from). MG
    runs in a thread: waiting there leaves EG free to finish that cut."""
    original = worker.model.forward_backward
    step = spec.crash_job_at
    assert step is not None

    def forward_backward(*args: Any) -> Any:
        if worker.model.steps == step:
            cut.kill_job_after_cut(spec.train.checkpoint_dir, spec.train.checkpoint_every, step,
                                   spec.shards, spec.workers)
        return original(*args)

    worker.model.forward_backward = forward_backward  # type: ignore[method-assign]


def worker_process(cluster: dict[str, list[str]], w: int, spec: JobSpec, results: Any) -> None:
    child_signals()
    worker_threads(spec)
    try:
        out = rvz.run(train_worker(cluster, w, spec), loop=spec.ps.loop)
    except BaseException as exc:
        results.put(("worker", w, {"error": describe_error(exc)}))
        raise SystemExit(1) from None
    results.put(("worker", w, out))


def worker_threads(spec: JobSpec) -> None:
    """In a worker's process. MG's numpy calls run in a thread and release the GIL, but need
    it back between calls; while EG's event loop holds it, the default 5 ms switch interval
    would be added to many of those calls. A short interval keeps MG's thread moving."""
    sys.setswitchinterval(spec.switch_interval)


def shard_process(cluster: dict[str, list[str]], shard: int, cfg: PSConfig, results: Any,
                  crash_at: int | None = None) -> None:
    child_signals()
    summary = rvz.run(run_shard(cluster, shard, cfg, crash_at=crash_at), loop=cfg.loop)
    results.put(("ps", shard, summary))


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def run_job(spec: JobSpec) -> dict[str, Any]:
    """Run one training job in child processes; worker 0's result (plus the shards' summaries)."""
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    cluster = local_cluster(spec.shards, spec.workers, spec.host)
    cfg = ps_config(spec.ps, spec.workers, spec.train.worker_rejoin)
    procs: dict[tuple[str, int], Any] = {}
    reports: dict[tuple[str, int], Any] = {}
    journal = None
    if spec.train.worker_rejoin > 0 and spec.train.journal is None:
        journal = tempfile.mkdtemp(prefix="rvz-journal-")
        spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, journal=journal))
    restarted: list[str] = []
    try:
        for s in range(spec.shards):
            crash_at = spec.kill_shard[1] + 1 if spec.kill_shard and spec.kill_shard[0] == s else None
            procs[("ps", s)] = ctx.Process(target=shard_process, args=(cluster, s, cfg, results, crash_at),
                                           name=f"ps{s}", daemon=True)
        for w in range(spec.workers):
            procs[("worker", w)] = ctx.Process(target=worker_process, args=(cluster, w, spec, results),
                                               name=f"worker{w}", daemon=True)
        with starting_child():
            for p in procs.values():
                p.start()
        def drain(timeout: float) -> None:
            """Take every report that arrives, until none came for ``timeout`` seconds."""
            try:
                while True:
                    job, task, report = results.get(timeout=timeout)
                    reports[(job, task)] = report
            except queue.Empty:
                pass

        def restart_killed() -> None:
            """A worker killed by a signal comes back as its task (it replays its step)."""
            for w in range(spec.workers):
                p = procs[("worker", w)]
                if p.exitcode is None or p.exitcode >= 0 or restarted.count(f"worker {w}") >= spec.restarts:
                    continue
                log.warning("worker %d was %s; starting it again as its task", w, describe_exit(p.exitcode))
                again = dataclasses.replace(spec, kill_worker=None)  # this process lives
                procs[("worker", w)] = ctx.Process(target=worker_process, args=(cluster, w, again, results),
                                                   name=f"worker{w}", daemon=True)
                with starting_child():
                    procs[("worker", w)].start()
                restarted.append(f"worker {w}")

        deadline = time.monotonic() + spec.timeout
        while time.monotonic() <= deadline:
            if spec.train.worker_rejoin > 0:
                restart_killed()
            if all(procs[("worker", w)].exitcode is not None for w in range(spec.workers)):
                break
            drain(0.05)
        # The shards finish once every worker left; give them (and the queue) a moment.
        end = time.monotonic() + min(10.0, spec.train.timeout)
        while time.monotonic() < end and any(p.exitcode is None for p in procs.values()):
            drain(0.05)
        drain(0.1)
        problems = []
        for (job, task), p in procs.items():
            report = reports.get((job, task))
            if isinstance(report, dict) and "error" in report:
                problems.append(f"{job} {task}: {report['error']}")
            elif p.exitcode != 0:
                problems.append(f"{job} {task}: {describe_exit(p.exitcode)}"
                                + (f" (no report after {spec.timeout:.0f} s)" if p.exitcode is None else ""))
        if problems:
            raise JobFailed("training failed:\n  " + "\n  ".join(problems))
        out = dict(reports[("worker", 0)])
        out["shards"] = [reports.get(("ps", s)) for s in range(spec.shards)]
        # Each restarted worker and the step its new process replayed from.
        out["rejoined"] = {w: reports[("worker", w)]["first_step"] for w in range(spec.workers)
                           if f"worker {w}" in restarted}
        return out
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for p in procs.values():
            if p.pid is not None:
                p.join(timeout=3)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=3)
        results.close()
        results.join_thread()
        if journal is not None:
            shutil.rmtree(journal, ignore_errors=True)
