"""Process plumbing: a loopback cluster, PS shard processes, and their clean-up.

Children are started with the ``spawn`` method (a fresh interpreter, no inherited event loop
or sockets) and report a small summary dict on a queue. ``Processes`` always terminates
(then kills) whatever is still running when its ``with`` block ends, whatever happened.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass
from typing import Any

import rvz

from ..common import free_ports
from .optimizers import make_optimizer
from .protocol import PS_JOB, WORKER_JOB
from .server import ShardServer
from .store import EmbeddingStore


@dataclass(frozen=True)
class PSConfig:
    """How to build and run a PS shard (picklable: it is handed to child processes)."""

    dim: int = 16
    optimizer: str = "adagrad"
    lr: float | None = None
    seed: int = 0
    init_scale: float = 0.05
    num_workers: int = 1
    evict_every: int = 0
    min_count: int = 2
    export_every: int = 0
    mode: str = "recv"
    loop: str = "auto"
    worker_job: str = WORKER_JOB


def make_store(cfg: PSConfig) -> EmbeddingStore:
    return EmbeddingStore(cfg.dim, make_optimizer(cfg.optimizer, cfg.lr), seed=cfg.seed,
                          init_scale=cfg.init_scale)


def local_cluster(num_shards: int, num_workers: int, worker_job: str = WORKER_JOB) -> dict[str, list[str]]:
    """A loopback cluster spec: ``num_shards`` ps tasks and ``num_workers`` worker tasks."""
    ports = free_ports(num_shards + num_workers)
    return {PS_JOB: [f"127.0.0.1:{p}" for p in ports[:num_shards]],
            worker_job: [f"127.0.0.1:{p}" for p in ports[num_shards:]]}


async def run_shard(cluster: dict[str, list[str]], shard: int, cfg: PSConfig) -> dict[str, Any]:
    """Run PS shard ``shard`` until every worker said END; returns its summary."""
    async with rvz.Node(cluster, PS_JOB, shard, mode=cfg.mode) as node:
        server = ShardServer(node, make_store(cfg), cfg.num_workers, worker_job=cfg.worker_job,
                             evict_every=cfg.evict_every, min_count=cfg.min_count,
                             export_every=cfg.export_every)
        await server.serve()
    return server.summary()


def shard_process(cluster: dict[str, list[str]], shard: int, cfg: PSConfig, results: Any) -> None:
    """Entry point of a PS shard process."""
    summary = rvz.run(run_shard(cluster, shard, cfg), loop=cfg.loop)
    results.put((PS_JOB, shard, summary))


class Processes:
    """Child processes started together; ``with`` guarantees none outlives the block."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.results: Any = self.ctx.Queue()
        self.procs: list[Any] = []
        self.collected: dict[tuple[str, int], Any] = {}  # (job, task) -> summary

    def start(self, name: str, target: Any, *args: Any) -> None:
        proc = self.ctx.Process(target=target, args=(*args, self.results), name=name, daemon=True)
        proc.start()
        self.procs.append(proc)

    def wait(self, timeout: float, names: list[str] | None = None) -> dict[tuple[str, int], Any]:
        """Wait for the named processes (all by default) to exit 0; collect the results.

        Results are drained while waiting: a child blocks at exit until its queued data
        has been read, so joining first could deadlock.
        """
        watched = [p for p in self.procs if names is None or p.name in names]
        collected = self.collected
        deadline = time.monotonic() + timeout
        while True:
            try:
                while True:
                    job, task, summary = self.results.get(timeout=0.05)
                    collected[(job, task)] = summary
            except queue.Empty:
                pass
            failed = [p for p in watched if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError("child process failed: " + ", ".join(
                    f"{p.name} (exit code {p.exitcode})" for p in failed))
            if all(p.exitcode == 0 for p in watched):
                # A summary may still be in flight in the queue's feeder pipe.
                for p in watched:
                    p.join()
                try:
                    while True:
                        job, task, summary = self.results.get(timeout=0.2)
                        collected[(job, task)] = summary
                except queue.Empty:
                    return collected
            if time.monotonic() > deadline:
                slow = [p.name for p in watched if p.exitcode is None]
                raise TimeoutError(f"child processes still running after {timeout}s: {slow}")

    def stop(self) -> None:
        """Terminate (then kill) every child still running, and reap them all."""
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=3)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=3)
        self.results.close()
        self.results.join_thread()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_shards(procs: Processes, cluster: dict[str, list[str]], cfg: PSConfig) -> None:
    for shard in range(len(cluster[PS_JOB])):
        procs.start(f"ps{shard}", shard_process, cluster, shard, cfg)
