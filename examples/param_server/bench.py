"""``python -m examples.param_server bench``: the PS's figures, each next to a baseline
measured in the same run.

* ``table``: warm lookups of 1M ids (dim 64, Adam rows) in batches of 4096 (evaluation
  reads, and training reads that stamp rows), against a dict of numpy rows on the same ids
  and against gathering as many random rows of a matrix of the table's shape, by numpy
  and by a compiled loop that prefetches (the memory system's own bound); the longest
  single batch while the table grows from 1M to 2M rows (new ids through
  ``lookup(create=True)``); index and row metadata bytes per id, at 1M and after every
  batch of the growth.
* ``checkpoint``: a full save of those 1M rows (embedding and Adam slots, flushed to disk),
  against one plain write + fsync of as many bytes, and against the same bytes written
  with ``O_DIRECT`` (the device without the page cache).
* ``pull`` / ``push``: 4096 unique ids x 64 float32 through 2 shard processes, against a raw
  blocking socket to another process that answers 4096 int64 with the same 1 MiB, and
  against the same exchange in bare rvz (shards that only answer: the PS's floor).

Each of the server's performance targets is printed as met or not, with the machine's load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import rvz

from ..common import LOCAL_HOST
from .client import PSClient
from .launch import Processes, PSConfig, keep_freed_memory, local_cluster, start_shards
from .native import core as native_core
from .native import implementation
from .optimizers import Adam
from .protocol import PS_JOB, PULL_IDS, PULL_ROWS, WORKER_JOB, edge
from .table import EmbeddingTable


def table_figures(n: int, dim: int, batch: int, rounds: int) -> tuple[dict[str, Any], EmbeddingTable]:
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(0, 1 << 62, int(n * 1.01)))[:n]
    rng.shuffle(ids)
    table = EmbeddingTable(dim, Adam(), "normal")
    for start in range(0, n, batch):
        table.lookup(ids[start:start + batch])
    table._core.finish()  # warm: no index growth left half done by the fill
    batches = [rng.choice(ids, batch) for _ in range(rounds)]
    for b in batches[:5]:
        table.lookup(b)
    # The memory system's bound for these reads, measured batch for batch in alternation
    # with them (the same memory in the same state): as many random rows of the table
    # itself (their embedding columns) copied out by the table's compiled gather, which
    # prefetches rows ahead as its lookup does but probes no index and checks no id.
    # (A separate matrix would be no bound: its speed depends on how much of it the cache
    # still holds from being written.)
    core = table._core
    picks = [rng.integers(0, n, batch).astype(np.int32) for _ in range(rounds)]
    picked = np.empty((batch, dim), dtype=np.float32)
    looking = gathering = 0.0
    for b, p in zip(batches, picks, strict=True):
        t0 = time.perf_counter()
        table.lookup(b, create=False)
        t1 = time.perf_counter()
        core.gather(p, picked, 0)
        gathering += time.perf_counter() - t1
        looking += t1 - t0
    lookups = rounds * batch / looking
    bound = rounds * batch / gathering
    started = time.perf_counter()
    for b in batches:
        table.lookup(b)  # the training read: every id present, rows stamped for TTL/LRU
    train_lookups = rounds * batch / (time.perf_counter() - started)
    # numpy's gather of as many random rows from a plain float32 matrix of the table's
    # shape (a row at a time), in memory of the same kind as the table's row blocks
    # (mapped from the OS, 4 KiB pages): what a numpy table would do.
    matrix = native_core.zeroed((n, table.width), np.float32)
    matrix[:, 0] = 1.0  # every page written: resident, as the table's rows are
    picks = [rng.integers(0, n, batch) for _ in range(rounds)]
    started = time.perf_counter()
    for p in picks:
        matrix[p, :dim]
    gather = rounds * batch / (time.perf_counter() - started)
    del matrix
    rows = dict(zip(ids.tolist(), table.lookup(ids, create=False), strict=True))  # dict of rows
    started = time.perf_counter()
    for b in batches:
        np.stack([rows[i] for i in b.tolist()])
    dict_lookups = rounds * batch / (time.perf_counter() - started)
    del rows
    return {"ids": n, "dim": dim, "batch": batch, "implementation": implementation(),
            "lookups_per_s": lookups, "train_lookups_per_s": train_lookups,
            "dict_lookups_per_s": dict_lookups,
            "speedup_vs_dict": lookups / dict_lookups,
            "numpy_gather_rows_per_s": gather, "ratio_to_numpy_gather": lookups / gather,
            "rows_gather_per_s": bound, "ratio_to_rows_gather": lookups / bound,
            "overhead_bytes_per_id": table.memory_overhead_per_id()}, table


def _thread_faults() -> int:
    """Page faults of the calling thread so far (-1 where the OS does not say)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt  # type: ignore[attr-defined]
    except (ImportError, AttributeError, OSError):
        return -1


def _steal_ms() -> float:
    """Time the host took from this virtual machine's CPUs so far, all CPUs together (Linux
    /proc/stat, in 10 ms ticks; -1 where there is no such count)."""
    try:
        with open("/proc/stat") as f:
            return 10.0 * int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return -1.0


def fresh_memory_ms(nbytes: int, rounds: int = 9) -> float:
    """Median time to write once to every page of ``nbytes`` of newly mapped memory: what a
    batch pays when the rows it creates land on pages nobody has written yet. On a virtual
    machine this is mostly the host's work (memory the guest freed may have been handed
    back to it), and it varies a lot from run to run."""
    times = []
    for _ in range(rounds):
        area = native_core.zeroed(nbytes // 4, np.float32).view(np.uint8)
        started = time.perf_counter()
        area[::4096] = 1
        times.append(time.perf_counter() - started)
        del area
    return 1e3 * float(np.median(times))


def growth_figures(table: EmbeddingTable, n: int, batch: int) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    fresh = (np.unique(rng.integers(0, 1 << 62, int(n * 1.01)))[:n]) | np.int64(1 << 62)
    stalls, overhead, faults, cpu, steal = [], [], [], [], []
    counted = _thread_faults() >= 0
    stolen = _steal_ms() >= 0
    for start in range(0, n, batch):
        before, s0 = _thread_faults(), _steal_ms()
        c0 = time.thread_time()
        t0 = time.perf_counter()
        table.lookup(fresh[start:start + batch])
        stalls.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        faults.append(_thread_faults() - before)
        steal.append(_steal_ms() - s0)
        overhead.append(table.memory_overhead_per_id())
    longest = int(np.argmax(stalls))
    return {"rows_after": len(table), "max_stall_ms": 1e3 * max(stalls),
            "p50_batch_ms": 1e3 * float(np.median(stalls)),
            # The longest batch's page faults (the helper thread had not backed its new
            # rows' pages yet), next to the cost of first writes to as many bytes as one
            # batch's new rows, measured in the same run: the floor under such a batch.
            "faults_in_longest_batch": faults[longest] if counted else None,
            # CPU time this thread spent in the longest batch: far below its wall time, the
            # thread was waiting (not running: the machine, or the GIL), not working.
            "cpu_ms_in_longest_batch": 1e3 * cpu[longest],
            # and time the host took from the machine's CPUs meanwhile (a virtual machine)
            "steal_ms_during_longest_batch": steal[longest] if stolen else None,
            "fresh_rows_memory_ms": fresh_memory_ms(batch * table.width * 4),
            # Bytes per id beyond the row after every batch of the growth: the index's
            # load moves in a saw-tooth, and a growing index has its successor beside it.
            "overhead_bytes_per_id_p50": float(np.median(overhead)),
            "overhead_bytes_per_id_max": float(max(overhead)),
            "overhead_bytes_per_id_after": table.memory_overhead_per_id()}


def _disk_write(path: Path, nbytes: int) -> float:
    """Seconds for one plain write of ``nbytes`` and one fsync: what the disk can do."""
    data = np.ones(nbytes, dtype=np.uint8)
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        view = memoryview(data)
        done = 0
        while done < nbytes:
            done += f.write(view[done:])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def _disk_write_direct(path: Path, nbytes: int) -> float | None:
    """Seconds for the same bytes written with ``O_DIRECT`` (page-aligned buffer, 8 MiB
    writes) and one fsync: what the device takes without the page cache; None if the file
    system refuses ``O_DIRECT``."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    chunk = 8 << 20
    area = mmap.mmap(-1, chunk)  # page-aligned
    area.write(b"\x01" * chunk)
    view = memoryview(area)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:
        return None
    try:
        started = time.perf_counter()
        done = 0
        aligned = nbytes - nbytes % 4096
        while done < aligned:
            done += os.write(fd, view[:min(chunk, aligned - done)])
        os.fsync(fd)
        seconds = time.perf_counter() - started
    finally:
        os.close(fd)
        view.release()
        area.close()
        path.unlink()
    return seconds


def checkpoint_figures(table: EmbeddingTable) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="ps-bench-"))
    try:
        started = time.perf_counter()
        table.save(root / "t")
        seconds = time.perf_counter() - started
        nbytes = sum(f.stat().st_size for f in (root / "t").rglob("*") if f.is_file())
        disk = _disk_write(root / "plain", nbytes)
        direct = _disk_write_direct(root / "direct", nbytes)
        return {"rows": len(table), "bytes": nbytes, "seconds": seconds,
                "write_gb_per_s": nbytes / seconds / 1e9,
                "disk_gb_per_s": nbytes / disk / 1e9, "ratio_to_disk": disk / seconds,
                "disk_direct_gb_per_s": nbytes / direct / 1e9 if direct else None,
                "ratio_to_disk_direct": direct / seconds if direct else None}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _echo_server(port_q: Any, nbytes: int, request: int) -> None:
    srv = socket.socket()
    srv.bind((LOCAL_HOST, 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reply = bytes(nbytes)
    buf = bytearray(request)
    while True:
        view, got = memoryview(buf), 0
        while got < request:
            k = conn.recv_into(view[got:])
            if k == 0:
                return
            got += k
        conn.sendall(reply)


def socket_figures(nbytes: int, request: int, rounds: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_echo_server, args=(q, nbytes, request), daemon=True)
    proc.start()
    try:
        sock = socket.create_connection((LOCAL_HOST, q.get(timeout=30)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out, buf = bytes(request), bytearray(nbytes)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            sock.sendall(out)
            view, got = memoryview(buf), 0
            while got < nbytes:
                got += sock.recv_into(view[got:])
            times.append(time.perf_counter() - t0)
        sock.close()
        return {"socket_ms_p50": 1e3 * float(np.median(times[5:]))}
    finally:
        proc.kill()
        proc.join(5)


def _floor_shard(cluster: dict[str, Any], shard: int, rows: int, dim: int, rounds: int,
                 loop: str) -> None:
    async def serve() -> None:
        async with rvz.Node(cluster, PS_JOB, shard, mode="recv") as node:
            reply = np.zeros((rows, dim), dtype=np.float32)
            for clock in range(rounds):
                await node.recv(edge(PULL_IDS, 0, shard, clock))
                await node.send(edge(PULL_ROWS, 0, shard, clock), reply)
            await node.recv(edge(PULL_IDS, 0, shard, rounds))  # the worker is done

    rvz.run(serve(), loop=loop)


async def _floor_worker(cluster: dict[str, Any], shards: int, rows: int, rounds: int) -> float:
    async with rvz.Node(cluster, WORKER_JOB, 0, mode="recv") as node:
        ids = np.arange(rows, dtype=np.int64)
        times = []
        for clock in range(rounds):
            t0 = time.perf_counter()
            await node.send_many([(edge(PULL_IDS, 0, s, clock), ids) for s in range(shards)])
            await node.recv_many([edge(PULL_ROWS, 0, s, clock) for s in range(shards)])
            times.append(time.perf_counter() - t0)
        await node.send_many([(edge(PULL_IDS, 0, s, rounds), ids[:1]) for s in range(shards)])
        await asyncio.sleep(0.2)
    return 1e3 * float(np.median(times[5:]))


def rvz_floor(shards: int, n: int, dim: int, rounds: int, loop: str) -> float:
    """The same exchange with bare rvz (ids out, ``n / shards`` rows back from each of
    ``shards`` processes that only answer): the floor under the PS's pull, in ms p50."""
    cluster = local_cluster(shards, 1)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_floor_shard, args=(cluster, s, n // shards, dim, rounds, loop),
                         daemon=True) for s in range(shards)]
    for proc in procs:
        proc.start()
    try:
        return rvz.run(_floor_worker(cluster, shards, n // shards, rounds), loop=loop)
    finally:
        for proc in procs:
            proc.join(5)
            proc.kill()


async def _pull_push(cluster: dict[str, Any], dim: int, n: int, rounds: int) -> dict[str, Any]:
    async with rvz.Node(cluster, WORKER_JOB, 0, mode="recv") as node:
        client = PSClient(node, len(cluster["ps"]), dim)
        rng = np.random.default_rng(2)
        ids = np.unique(rng.integers(0, 1 << 62, n + 64))[:n]
        grads = rng.standard_normal((n, dim)).astype(np.float32)
        pulls, pushes = [], []
        for step in range(rounds):
            t0 = time.perf_counter()
            await client.lookup_unique(ids, step)
            t1 = time.perf_counter()
            await client.push_unique(ids, grads, step)
            pulls.append(t1 - t0)
            pushes.append(time.perf_counter() - t1)
        await client.close()
    return {"ids": n, "dim": dim, "shards": len(cluster["ps"]), "batch_api": hasattr(rvz.Node, "send_many"),
            "ms_p50": 1e3 * float(np.median(pulls[5:])), "push_ms_p50": 1e3 * float(np.median(pushes[5:]))}


def targets(figures: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The performance targets against this run's figures."""
    table, pull, ckpt = figures["table"], figures["pull"], figures["checkpoint"]
    rows = [("table.lookups_per_s", table["lookups_per_s"], ">=", 20e6),
            ("table.speedup_vs_dict", table["speedup_vs_dict"], ">=", 10.0),
            ("table.max_stall_ms", table["max_stall_ms"], "<=", 10.0),
            # Index and row metadata, the worst after any batch of the growth to 2M ids.
            ("table.overhead_bytes_per_id_max", table["growth"]["overhead_bytes_per_id_max"],
             "<=", 32.0),
            ("pull.ratio_to_socket", pull["ratio_to_socket"], "<=", 2.0),
            ("checkpoint.write_gb_per_s", ckpt["write_gb_per_s"], ">=", 0.5)]
    return {name: {"value": value, "op": op, "bound": bound,
                   "met": bool(value >= bound if op == ">=" else value <= bound)}
            for name, value, op, bound in rows}


def main(args: argparse.Namespace) -> int:
    quick = args.quick
    # As in every PS process (shards, workers): freed memory stays in the process. The
    # socket and bare-rvz baselines below run with the same setting.
    keep_freed_memory()
    n = 20_000 if quick else 1_000_000
    dim, batch = 64, 4096
    print(f"param_server bench: table core {implementation()}, rvz {rvz.implementation()}", flush=True)
    figures: dict[str, Any] = {}
    table, table_obj = table_figures(n, dim, batch, 20 if quick else 200)
    figures["table"] = table
    print(f"table: {table['lookups_per_s'] / 1e6:.1f}M lookups/s (training reads "
          f"{table['train_lookups_per_s'] / 1e6:.1f}M/s) vs dict "
          f"{table['dict_lookups_per_s'] / 1e6:.2f}M/s ({table['speedup_vs_dict']:.1f}x), numpy gather of "
          f"as many rows {table['numpy_gather_rows_per_s'] / 1e6:.1f}M/s "
          f"({table['ratio_to_numpy_gather']:.2f}x), the table's own rows gathered without "
          f"its index {table['rows_gather_per_s'] / 1e6:.1f}M/s ({table['ratio_to_rows_gather']:.2f}x); "
          f"{table['overhead_bytes_per_id']:.1f} B/id beyond the row", flush=True)
    figures["checkpoint"] = checkpoint_figures(table_obj)
    c = figures["checkpoint"]
    print(f"checkpoint: {c['bytes'] / 1e6:.0f} MB in {c['seconds']:.2f} s = "
          f"{c['write_gb_per_s']:.2f} GB/s (a plain write + fsync of as many bytes: "
          f"{c['disk_gb_per_s']:.2f} GB/s; ratio {c['ratio_to_disk']:.2f}; with O_DIRECT: "
          + (f"{c['disk_direct_gb_per_s']:.2f} GB/s; ratio {c['ratio_to_disk_direct']:.2f})"
             if c["disk_direct_gb_per_s"] else "not possible here)"), flush=True)
    growth = growth_figures(table_obj, n, batch)
    table["max_stall_ms"] = growth["max_stall_ms"]
    table["growth"] = growth
    print(f"growth {n}->{growth['rows_after']} rows: longest batch {growth['max_stall_ms']:.1f} ms "
          f"(median {growth['p50_batch_ms']:.1f} ms; the longest ran "
          f"{growth['cpu_ms_in_longest_batch']:.1f} ms on the CPU, took "
          f"{growth['faults_in_longest_batch']} page faults, and the host took "
          f"{growth['steal_ms_during_longest_batch']} ms of CPU meanwhile; first writes to one batch's "
          f"worth of new rows take {growth['fresh_rows_memory_ms']:.1f} ms here); "
          f"B/id beyond the row during it: median "
          f"{growth['overhead_bytes_per_id_p50']:.1f}, max {growth['overhead_bytes_per_id_max']:.1f}, "
          f"at 2M {growth['overhead_bytes_per_id_after']:.1f}", flush=True)
    del table_obj
    cfg = PSConfig(dim=dim, optimizer="adagrad", num_workers=1, mode="recv", loop=args.loop)
    cluster = local_cluster(2, 1)
    rounds = 20 if quick else 200
    with Processes() as procs:
        start_shards(procs, cluster, cfg)
        pp = rvz.run(_pull_push(cluster, dim, batch, rounds), loop=args.loop)
        procs.wait(60)
    sock = socket_figures(batch * dim * 4, batch * 8, rounds)
    floor = rvz_floor(2, batch, dim, rounds, args.loop)
    figures["pull"] = {"ms_p50": pp["ms_p50"], "socket_ms_p50": sock["socket_ms_p50"],
                       "ratio_to_socket": pp["ms_p50"] / sock["socket_ms_p50"],
                       "rvz_floor_ms_p50": floor, "rvz_floor_ratio_to_socket": floor / sock["socket_ms_p50"],
                       "ids": batch, "dim": dim, "shards": 2, "batch_api": pp["batch_api"]}
    figures["push"] = {"ms_p50": pp["push_ms_p50"],
                       "ratio_to_socket": pp["push_ms_p50"] / sock["socket_ms_p50"]}
    print(f"pull 4096x{dim} via 2 shards: {pp['ms_p50']:.2f} ms p50 vs raw socket "
          f"{sock['socket_ms_p50']:.2f} ms "
          f"({figures['pull']['ratio_to_socket']:.1f}x; bare rvz, same exchange: {floor:.2f} ms = "
          f"{figures['pull']['rvz_floor_ratio_to_socket']:.1f}x); push {pp['push_ms_p50']:.2f} ms p50",
          flush=True)
    figures["targets"] = targets(figures)
    for name, t in figures["targets"].items():
        print(f"target {name}: {t['value']:.3g} {t['op']} {t['bound']:.3g}: "
              f"{'met' if t['met'] else 'NOT met'}", flush=True)
    figures["load_average"] = os.getloadavg()
    print(f"load average (1, 5, 15 min): {figures['load_average']} on {os.cpu_count()} CPUs", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


