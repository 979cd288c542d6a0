"""Process plumbing: the service's configuration, PS shard processes, and their clean-up.

``PSConfig`` says what a shard serves (its tables and policies) and how (consistency,
checkpoints); it is picklable, for child processes. ``run_shard`` runs one shard, fresh or
restored from its checkpoint directory (then its epoch goes up by one, see protocol.py).

Children are started with the ``spawn`` method (a fresh interpreter, no inherited event loop
or sockets) and report a small summary dict on a queue. ``Processes`` always terminates
(then kills) whatever is still running when its ``with`` block ends, whatever happened; with
``restart=`` it starts a shard again, restored, when it dies.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rvz

from ..common import LOCAL_HOST, child_signals, free_ports, starting_child, tls_contexts
from .checkpoint import has_checkpoint
from .cut import load_shard_part
from .optimizers import make_optimizer
from .protocol import PS_JOB, REPLICA_JOB, WORKER_JOB
from .server import ShardServer
from .table import EmbeddingTable, MinCount


@dataclass(frozen=True)
class TableSpec:
    """One table of the service."""

    name: str = "default"
    dim: int = 16
    optimizer: str = "adagrad"
    lr: float | None = None


@dataclass(frozen=True)
class PSConfig:
    """How to build and run a PS shard (picklable: it is handed to child processes).

    ``tables`` empty means one table named ``"default"`` of ``dim``/``optimizer``/``lr``.
    """

    dim: int = 16
    optimizer: str = "adagrad"
    lr: float | None = None
    seed: int = 0
    tables: tuple[TableSpec, ...] = ()
    initializer: str = "normal"
    init_std: float = 0.01
    min_count: int = 0          # admission: lookups before an id gets a row (0: none)
    ttl: int | None = None      # eviction: steps without access
    max_rows: int | None = None  # eviction: LRU bound per table and shard
    num_workers: int = 1
    consistency: str = "asp"
    staleness: int = 0
    evict_every: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    full_every: int = 4
    fsync: bool = True
    mode: str = "recv"
    loop: str = "auto"
    worker_job: str = WORKER_JOB
    node_options: dict[str, Any] = field(default_factory=dict)
    progress_every: float = 0.0  # seconds between a shard's progress lines (0: none)
    tls: tuple[str, str, str] | None = None  # (ca, cert, key) files: mutual TLS between nodes
    cut_every: int = 0               # whole-job cuts every this many clocks (bsp; see cut.py)
    cut_root: str | None = None      # ... written under this directory
    resume_cut: str | None = None    # start from this cut directory (and its clock) instead of empty
    start_clock: int = 0             # the clock of ``resume_cut``
    worker_rejoin: float = 0.0       # seconds a lost worker's place waits for a new process (0: none)

    def node_kwargs(self) -> dict[str, Any]:
        """Options of every node of the service (TLS contexts built here, in the process
        that runs the node)."""
        return {**self.node_options, **({"ssl": tls_contexts(self.tls)} if self.tls else {})}

    def table_specs(self) -> tuple[TableSpec, ...]:
        return self.tables or (TableSpec("default", self.dim, self.optimizer, self.lr),)

    def dims(self) -> dict[str, int]:
        return {t.name: t.dim for t in self.table_specs()}


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(limit: int = 256 << 20) -> bool:
    """Have glibc's malloc keep freed memory in the process (up to ``limit`` bytes) rather
    than hand it back to the OS. A PS process allocates and frees the same large arrays
    every step (received ids and gradients, rows to send, optimizer temporaries); returned
    to the OS, each new one is faulted in and zeroed page by page again, which doubled a
    shard's time per pull and tripled it per push. Returns False where this is not glibc."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # Large blocks from the heap instead of their own mapping, and no trimming of the heap
    # below ``limit``; 32 MiB blocks and above (table row blocks are mapped separately
    # anyway) still get their own mapping.
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, limit))


def make_table(cfg: PSConfig, spec: TableSpec) -> EmbeddingTable:
    return EmbeddingTable(spec.dim, make_optimizer(spec.optimizer, spec.lr), cfg.initializer,
                          cfg.seed, init_std=cfg.init_std,
                          admission=MinCount(cfg.min_count) if cfg.min_count > 1 else None,
                          ttl=cfg.ttl, max_rows=cfg.max_rows)


def make_tables(cfg: PSConfig) -> dict[str, EmbeddingTable]:
    return {spec.name: make_table(cfg, spec) for spec in cfg.table_specs()}


def make_store(cfg: PSConfig) -> EmbeddingTable:
    """The first (or only) table of ``cfg``."""
    return make_table(cfg, cfg.table_specs()[0])


def local_cluster(num_shards: int, num_workers: int, worker_job: str = WORKER_JOB,
                  host: str = LOCAL_HOST) -> dict[str, list[str]]:
    """A one-machine cluster spec: ``num_shards`` ps tasks and ``num_workers`` worker tasks,
    on free ports of ``host``."""
    ports = free_ports(num_shards + num_workers, host)
    return {PS_JOB: [f"{host}:{p}" for p in ports[:num_shards]],
            worker_job: [f"{host}:{p}" for p in ports[num_shards:]]}


def shard_dir(cfg: PSConfig, shard: int) -> Path | None:
    return Path(cfg.checkpoint_dir) / f"ps{shard}" if cfg.checkpoint_dir else None


def _next_epoch(root: Path, restore: bool) -> int:
    """The epoch of this start: 0 fresh, previous + 1 when restoring (kept in ``EPOCH``)."""
    path = root / "EPOCH"
    epoch = int(path.read_text()) + 1 if restore and path.exists() else 0
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".EPOCH-{os.getpid()}"
    tmp.write_text(str(epoch))
    os.replace(tmp, path)
    return epoch


def open_shard(cfg: PSConfig, shard: int, restore: bool) -> tuple[dict[str, EmbeddingTable], int, bool]:
    """The tables of ``shard`` (restored from its last checkpoint if asked and present), the
    epoch to serve them at, and whether every table came from a checkpoint. A shard restored
    before its first checkpoint starts with empty tables (at the next epoch all the same:
    its workers must rejoin it)."""
    root = shard_dir(cfg, shard)
    if root is None:
        if restore:
            raise ValueError("restoring needs a checkpoint directory")
        return make_tables(cfg), 0, False
    epoch = _next_epoch(root, restore)
    tables = make_tables(cfg)
    restored = 0
    if restore:
        for name in tables:
            if has_checkpoint(root / name):
                tables[name] = EmbeddingTable.load(root / name)
                restored += 1
    return tables, epoch, restore and restored == len(tables)


async def run_shard(cluster: dict[str, Any], shard: int, cfg: PSConfig,
                    restore: bool = False, crash_at: int | None = None) -> dict[str, Any]:
    """Run PS shard ``shard`` until every worker left; returns its summary. ``crash_at``: the
    process kills itself (SIGKILL) when the slowest worker reaches that clock (a demo)."""
    if cfg.resume_cut is not None:
        # A whole job resumed from a cut: a fresh start (epoch 0) of every process, at the
        # cut's clock; the shard's own checkpoint directory is not involved.
        tables, epoch, restored = load_shard_part(Path(cfg.resume_cut), shard), 0, False
    else:
        tables, epoch, restored = open_shard(cfg, shard, restore)
    async with rvz.Node(cluster, PS_JOB, shard, mode=cfg.mode, **cfg.node_kwargs()) as node:
        server = ShardServer(node, tables, cfg.num_workers, worker_job=cfg.worker_job,
                             consistency=cfg.consistency, staleness=cfg.staleness,
                             evict_every=cfg.evict_every, checkpoint_dir=shard_dir(cfg, shard),
                             checkpoint_every=cfg.checkpoint_every, full_every=cfg.full_every,
                             epoch=epoch, fsync=cfg.fsync, progress_every=cfg.progress_every,
                             start_clock=cfg.start_clock, cut_every=cfg.cut_every, cut_root=cfg.cut_root,
                             replicas=len(cluster.get(REPLICA_JOB, [])), worker_rejoin=cfg.worker_rejoin)
        if restored:
            # The next save may add an increment to the restored chain. Without a full
            # checkpoint of every table on disk (a crash before the first save) it must be a
            # full one: an increment would have nothing to extend.
            server._saves = 1
        server.crash_at = crash_at
        await server.serve()
    return server.summary()


def shard_process(cluster: dict[str, Any], shard: int, cfg: PSConfig, restore: bool,
                  results: Any, crash_at: int | None = None) -> None:
    """Entry point of a PS shard process."""
    child_signals()
    keep_freed_memory()
    summary = rvz.run(run_shard(cluster, shard, cfg, restore, crash_at), loop=cfg.loop)
    results.put((PS_JOB, shard, summary))


class Processes:
    """Child processes started together; ``with`` guarantees none outlives the block."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.results: Any = self.ctx.Queue()
        self.procs: list[Any] = []
        self.collected: dict[tuple[str, int], Any] = {}  # (job, task) -> summary
        self.restarts: list[str] = []

    def start(self, name: str, target: Any, *args: Any, **kwargs: Any) -> Any:
        proc = self.ctx.Process(target=target, args=(*args, self.results), kwargs=kwargs, name=name,
                                daemon=True)
        with starting_child():
            proc.start()
            self.procs.append(proc)
        return proc

    def wait(self, timeout: float, names: list[str] | None = None,
             restart: Callable[[str], bool] | None = None) -> dict[tuple[str, int], Any]:
        """Wait for the named processes (all by default) to exit 0; collect the results.
        ``restart(name)``, if given, may start a dead child again (returns True if it did).

        Results are drained while waiting: a child blocks at exit until its queued data
        has been read, so joining first could deadlock.
        """
        collected = self.collected
        deadline = time.monotonic() + timeout
        while True:
            watched = [p for p in self.procs if names is None or p.name in names]
            try:
                while True:
                    job, task, summary = self.results.get(timeout=0.05)
                    collected[(job, task)] = summary
            except queue.Empty:
                pass
            failed = [p for p in watched if p.exitcode not in (None, 0)]
            for p in failed:
                if restart is not None and restart(p.name):
                    self.procs.remove(p)
                    self.restarts.append(p.name)
                    failed = []
                    break
            if failed:
                raise RuntimeError("child process failed: " + ", ".join(
                    f"{p.name} (exit code {p.exitcode})" for p in failed))
            if watched and all(p.exitcode == 0 for p in watched):
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

    def get(self, name: str) -> Any:
        return next(p for p in self.procs if p.name == name)

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


def start_shards(procs: Processes, cluster: dict[str, Any], cfg: PSConfig,
                 crash: tuple[int, int] | None = None) -> None:
    """Start every shard; ``crash=(shard, clock)``: that shard's first incarnation kills
    itself (SIGKILL) once the slowest worker reached ``clock``."""
    for shard in range(len(cluster[PS_JOB])):
        crash_at = crash[1] if crash is not None and crash[0] == shard else None
        procs.start(f"ps{shard}", shard_process, cluster, shard, cfg, False, crash_at=crash_at)


def restarter(procs: Processes, cluster: dict[str, Any], cfg: PSConfig) -> Callable[[str], bool]:
    """For ``Processes.wait(restart=...)``: a dead shard is started again from its checkpoint."""
    def restart(name: str) -> bool:
        if not name.startswith("ps") or cfg.checkpoint_dir is None:
            return False
        shard = int(name[2:])
        procs.start(name, shard_process, cluster, shard, cfg, True)
        return True
    return restart


def cluster_from_args(cluster_json: str | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The cluster spec from ``--cluster`` JSON (a string, or a file path), else from
    ``TF_CONFIG``; also TF_CONFIG's ``task`` ({"type", "index"}) when it has one."""
    if cluster_json:
        text = Path(cluster_json).read_text() if os.path.exists(cluster_json) else cluster_json
        return json.loads(text), None
    tf_config = os.environ.get("TF_CONFIG")
    if not tf_config:
        raise ValueError("no cluster: pass --cluster JSON or set TF_CONFIG")
    config = json.loads(tf_config)
    return config["cluster"], config.get("task")


def resolve_task(cluster_json: str | None, job: str | None, index: int | None, wanted: str | tuple[str, ...],
                 command: str) -> tuple[dict[str, Any], str, int]:
    """The cluster (``--cluster``, else ``TF_CONFIG``) and this process's (job, task), from
    ``--job``/``--task`` or TF_CONFIG's task, checked: ValueError says what is wrong. The job
    must be one of ``wanted``."""
    try:
        cluster, task = cluster_from_args(cluster_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the cluster is not valid JSON: {exc}") from None
    except OSError as exc:
        raise ValueError(f"cannot read the cluster: {exc}") from None
    if not isinstance(cluster, dict):
        raise ValueError(f"the cluster must be a JSON object of job -> list of \"host:port\", "
                         f"not {type(cluster).__name__}")
    for name in (PS_JOB, WORKER_JOB):
        tasks = cluster.get(name)
        if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
            raise ValueError(f"the cluster needs a non-empty list of \"host:port\" for job {name!r}")
    if task is not None and not isinstance(task, dict):
        raise ValueError("TF_CONFIG's task must be an object {\"type\": ..., \"index\": ...}")
    name: Any = job or (task or {}).get("type")
    number: Any = index if index is not None else (task or {}).get("index")
    if name is None or number is None:
        raise ValueError("say which task this is: --job and --task, or TF_CONFIG's task")
    wanted = (wanted,) if isinstance(wanted, str) else wanted
    if name not in wanted:
        raise ValueError(f"{command} runs a {' or '.join(map(repr, wanted))} task, not {name!r}")
    if not isinstance(number, int) or not 0 <= number < len(cluster[name]):
        raise ValueError(f"task {number!r}: job {name!r} has tasks 0 to {len(cluster[name]) - 1}")
    return cluster, name, number
