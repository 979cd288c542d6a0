"""Whole-job checkpoints: one consistent cut of every shard and every worker at one clock.

A cut at clock C holds each shard's tables after the pushes of clocks 0..C-1 were applied
(and before any acknowledgement of clock C-1 left, so before any later pull), and each
worker's own state at the same point (written by the application: the pipeline's dense
model, its optimizer, the rows it pulled ahead, its losses). Layout, under the job's
checkpoint directory::

    JOB.json                      the job's settings (written by whoever starts the job)
    cut-00000012/ps0/<table>/     shard 0's tables (full checkpoint entries, CRC-checked)
    cut-00000012/ps0.done.json    written last, once shard 0's part is on disk
    cut-00000012/worker1.npz      worker 1's arrays
    cut-00000012/worker1.done.json   its size and CRC-32, and the worker's own metadata

A part counts once its ``.done.json`` is there; a cut counts once every part of the job
does (and, for a worker, the CRC-32 matches). ``latest`` never returns an incomplete cut;
when there is none, its error names what the newest cut lacks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .sparse import shard_of
from .table import EmbeddingTable, TableSnapshot, write_snapshot

JOB = "JOB.json"
# How ids map to shards, recorded with every job: a cut can only be served by as many shards,
# mapped the same way (``reshard`` changes the count).
SHARDING = "mix64(id ^ 0x5BD1E9955BD1E995) % shards"
_CUT = re.compile(r"cut-(\d{8})")


class CutError(Exception):
    """No usable cut: missing, incomplete, corrupt, or taken by another job."""


def cut_dir(root: str | Path, clock: int) -> Path:
    return Path(root) / f"cut-{clock:08d}"


def parts(num_shards: int, num_workers: int) -> list[str]:
    return [f"ps{s}" for s in range(num_shards)] + [f"worker{w}" for w in range(num_workers)]


def _write_json(path: Path, value: Any, fsync: bool = True) -> None:
    """``path`` replaced atomically (written under a temporary name, flushed, renamed)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(value, f, sort_keys=True)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_job(root: str | Path, settings: dict[str, Any]) -> None:
    Path(root).mkdir(parents=True, exist_ok=True)
    _write_json(Path(root) / JOB, settings)


def read_job(root: str | Path) -> dict[str, Any]:
    path = Path(root) / JOB
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        raise CutError(f"no job checkpoint in {root} (no {JOB})") from None
    except ValueError as exc:
        raise CutError(f"{path} is not valid JSON: {exc}") from None


# -- a shard's part ------------------------------------------------------------------------------

def write_shard_part(root: str | Path, clock: int, shard: int, snapshots: dict[str, TableSnapshot],
                     fsync: bool = True) -> Path:
    """Shard ``shard``'s tables (copied out by ``EmbeddingTable.snapshot``) into the cut at
    ``clock``; the marker last. Runs in a helper thread: nothing here touches the tables."""
    where = cut_dir(root, clock)
    mine = where / f"ps{shard}"
    if mine.exists():
        shutil.rmtree(mine)  # left by an incarnation that died while writing it
    for name, snap in snapshots.items():
        write_snapshot(snap, mine / name, fsync=fsync)
    _write_json(where / f"ps{shard}.done.json",
                {"clock": clock, "shard": shard, "tables": list(snapshots),
                 "live": {name: len(snap.ids) for name, snap in snapshots.items()}}, fsync)
    return where


def load_shard_part(where: Path, shard: int) -> dict[str, EmbeddingTable]:
    marker = json.loads((where / f"ps{shard}.done.json").read_text())
    return {name: EmbeddingTable.load(where / f"ps{shard}" / name) for name in marker["tables"]}


# -- a worker's part -----------------------------------------------------------------------------

def write_worker_part(root: str | Path, clock: int, worker: int, arrays: dict[str, np.ndarray],
                      meta: dict[str, Any], fsync: bool = True) -> Path:
    """Worker ``worker``'s arrays and metadata into the cut at ``clock``; the marker last."""
    where = cut_dir(root, clock)
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"worker{worker}.npz"
    tmp = where / f".tmp-worker{worker}-{os.getpid()}.npz"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    data = path.read_bytes()
    _write_json(where / f"worker{worker}.done.json",
                {"clock": clock, "worker": worker, "bytes": len(data), "crc32": zlib.crc32(data),
                 "meta": meta}, fsync)
    return where


def load_worker_part(where: Path, worker: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    marker = json.loads((where / f"worker{worker}.done.json").read_text())
    data = (where / f"worker{worker}.npz").read_bytes()
    if len(data) != marker["bytes"] or zlib.crc32(data) != marker["crc32"]:
        raise CutError(f"{where}/worker{worker}.npz: size or checksum mismatch (corrupt)")
    with np.load(where / f"worker{worker}.npz") as npz:
        arrays = {name: npz[name] for name in npz.files}
    return arrays, marker["meta"]


# -- finding a cut ---------------------------------------------------------------------------------

def missing(where: Path, num_shards: int, num_workers: int) -> list[str]:
    """The parts of the job the cut ``where`` lacks (none: it is complete)."""
    lacking = []
    for part in parts(num_shards, num_workers):
        marker = where / f"{part}.done.json"
        if not marker.exists():
            lacking.append(part)
        elif part.startswith("worker"):
            info = json.loads(marker.read_text())
            npz = where / f"{part}.npz"
            if not npz.exists() or npz.stat().st_size != info["bytes"]:
                lacking.append(f"{part} (its arrays are missing or cut short)")
    return lacking


def cuts(root: str | Path) -> list[tuple[int, Path]]:
    """Every cut directory under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _CUT.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def latest(root: str | Path, num_shards: int, num_workers: int) -> tuple[int, Path]:
    """The newest complete cut (clock, directory); CutError naming what the newest lacks."""
    found = cuts(root)
    for clock, where in reversed(found):
        if not missing(where, num_shards, num_workers):
            return clock, where
    if not found:
        raise CutError(f"no checkpoint in {root}: no cut-NNNNNNNN directory (was the job run with "
                       f"--checkpoint-every and this --checkpoint-dir?)")
    clock, where = found[-1]
    raise CutError(f"no complete checkpoint in {root}: the newest, {where.name} (step {clock}), lacks "
                   + ", ".join(missing(where, num_shards, num_workers))
                   + (f"; so do the {len(found) - 1} older ones" if len(found) > 1 else ""))


def kill_job_after_cut(root: str | Path | None, every: int, step: int, num_shards: int,
                       num_workers: int, timeout: float = 30.0) -> None:
    """SIGKILL every process of this process group (a whole job, started in a group of its
    own) once the last cut at or before ``step`` is complete: a demo of ``--resume``, and its
    test. Blocks (call it from a thread, or where blocking is fine)."""
    if every and root is not None and step >= every:
        wanted = step // every * every
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if latest(root, num_shards, num_workers)[0] >= wanted:
                    break
            except CutError:
                pass
            time.sleep(0.02)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def reshard(src: str | Path, dst: str | Path, num_shards: int, fsync: bool = True) -> tuple[int, int]:
    """Write ``src``'s newest complete cut into ``dst`` for ``num_shards`` shards: every row
    (embedding, optimizer slots, stamp) and admission count moves, unchanged, to the shard
    ``sparse.shard_of`` gives it among ``num_shards``; the workers' parts are copied as they
    are; ``dst``'s JOB.json says the new count. Returns (clock, rows moved). The tables'
    counters: the global step is the same on every shard and stays; ``created`` becomes the
    rows a shard holds and ``evicted``/``dropped`` start at 0 (they were per shard)."""
    job = read_job(src)
    old, workers = int(job["shards"]), int(job["workers"])
    if num_shards < 1:
        raise CutError(f"--shards {num_shards}: a job needs at least one shard")
    clock, where = latest(src, old, workers)
    out = cut_dir(dst, clock)
    if out.exists() or (Path(dst) / JOB).exists():
        raise CutError(f"{dst} already holds a job checkpoint: reshard into a new directory")
    names = json.loads((where / "ps0.done.json").read_text())["tables"]
    moved = 0
    new: list[dict[str, TableSnapshot]] = [{} for _ in range(num_shards)]
    for name in names:
        snaps = [EmbeddingTable.load(where / f"ps{s}" / name).snapshot() for s in range(old)]
        steps = {snap.state["global_step"] for snap in snaps}
        if len(steps) != 1 or len({json.dumps(snap.config, sort_keys=True) for snap in snaps}) != 1:
            raise CutError(f"{where}: table {name!r} differs between shards (global steps {sorted(steps)}): "
                           f"not one job's cut")
        ids = np.concatenate([snap.ids for snap in snaps])
        rows = np.concatenate([snap.rows for snap in snaps])
        stamps = np.concatenate([snap.stamps for snap in snaps])
        cand_ids = np.concatenate([snap.cand_ids for snap in snaps])
        cand_counts = np.concatenate([snap.cand_counts for snap in snaps])
        owner, cand_owner = shard_of(ids, num_shards), shard_of(cand_ids, num_shards)
        for s in range(num_shards):
            mine = owner == s
            state = {**snaps[0].state, "created": int(mine.sum()), "evicted": 0, "dropped": 0,
                     "version": max(snap.state["version"] for snap in snaps)}
            new[s][name] = TableSnapshot(ids[mine], rows[mine], stamps[mine], cand_ids[cand_owner == s],
                                         cand_counts[cand_owner == s], snaps[0].config, state)
        moved += len(ids)
    for s in range(num_shards):
        write_shard_part(dst, clock, s, new[s], fsync)
    for w in range(workers):
        for suffix in (".npz", ".done.json"):
            shutil.copyfile(where / f"worker{w}{suffix}", out / f"worker{w}{suffix}")
    write_job(dst, {**job, "shards": num_shards})
    return clock, moved


def prune(root: str | Path, num_shards: int, num_workers: int, keep: int = 2) -> None:
    """Remove all but the ``keep`` newest complete cuts (and incomplete ones older than them)."""
    complete = [c for c in cuts(root) if not missing(c[1], num_shards, num_workers)]
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep][0]
    for clock, where in cuts(root):
        if clock < oldest_kept:
            shutil.rmtree(where, ignore_errors=True)
