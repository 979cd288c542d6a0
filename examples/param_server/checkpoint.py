"""Checkpoint directories: atomic entries, a manifest, and checksums.

A checkpoint directory holds a chain of entries: one full entry, then incremental ones,
each a subdirectory ``NNNNNN-full`` or ``NNNNNN-incr``. An entry is written under a
temporary name, its files flushed to disk, then renamed into place; ``MANIFEST.json`` (the
chain, and every file's size and CRC-32) is replaced the same way, last. A crash at any
moment leaves the previous manifest and the entries it names intact; a reader verifies
every checksum before using a byte. One process writes a checkpoint directory at a time: the
next writer removes what a crashed one left (temporary names, and an entry renamed into
place whose manifest was never written), since only the manifest says what exists.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "MANIFEST.json"
_ENTRY = re.compile(r"(\d{6,})-(?:full|incr)")  # an entry's name: its sequence number, its kind
FORMAT = "rvz-param-server-checkpoint/1"


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or corrupt."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_CRC = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-crc")
_CRC_THREAD_MIN = 1 << 20  # smaller files: checksum inline


def _crc32(views: list[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return crc


def _write_all(f: Any, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += f.write(view[done:])


_DIRECT_ALIGN = 4096  # O_DIRECT: memory address, file offset and length in these units
_DIRECT_MIN = 1 << 20


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


def _open_direct(path: Path) -> int | None:
    """``path`` created for writing with ``O_DIRECT``, or None where that is not possible
    (no such flag, or a file system that refuses it, such as tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:
        return None


def _write_file(path: Path, views: list[memoryview], *, direct: bool, fsync: bool) -> None:
    """Write ``views`` back to back into a new file ``path``.

    With ``direct``, the leading run of page-aligned data (aligned address, aligned length,
    at an aligned offset) is written with ``O_DIRECT``; from the first piece that is not,
    the file is reopened for appending normally. Then one fsync if asked."""
    rest = list(views)
    done = 0
    fd = _open_direct(path) if direct and sum(len(v) for v in views) >= _DIRECT_MIN else None
    if fd is not None:
        try:
            while rest:
                view = rest[0]
                aligned = len(view) - len(view) % _DIRECT_ALIGN
                if aligned == 0 or _address(view) % _DIRECT_ALIGN:
                    break
                _write_fd(fd, view[:aligned])
                done += aligned
                if aligned < len(view):
                    rest[0] = view[aligned:]
                    break
                rest.pop(0)
        finally:
            os.close(fd)
    with open(path, "ab" if done else "wb", buffering=0) as f:
        for view in rest:
            _write_all(f, view)
        if fsync:
            os.fsync(f.fileno())


def _write_fd(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


class EntryWriter:
    """Writes the files of one entry into a temporary directory; ``commit`` publishes it."""

    def __init__(self, root: Path, kind: str, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        manifest = read_manifest(self.root, missing_ok=True)
        self.seq = (manifest["seq"] + 1) if manifest else 1
        self.kind = kind
        self.name = f"{self.seq:06d}-{kind}"
        self.tmp = self.root / f".tmp-{self.name}-{os.getpid()}"
        _remove_leftovers(self.root, self.seq)
        self.tmp.mkdir()
        self.fsync = fsync
        self.files: dict[str, dict[str, Any]] = {}
        self.manifest = manifest

    def array(self, name: str, array: np.ndarray) -> None:
        """Write ``array`` raw (C order) as ``name``; dtype and shape go to the manifest."""
        array = np.ascontiguousarray(array)
        self.arrays(name, [array], array.shape, array.dtype)

    def arrays(self, name: str, parts: list[np.ndarray], shape: tuple[int, ...],
               dtype: Any = None) -> None:
        """Write ``parts`` (C-order arrays of one dtype) back to back as one array ``name``
        of ``shape``: one large write per part, no per-row work. The CRC-32 is computed by a
        helper thread while the parts are written (both release the GIL), and the file is
        flushed to disk once, at the end. With ``fsync``, page-aligned parts (the table's
        row blocks) go straight to the device (``O_DIRECT``: no copy into the page cache,
        and the flush at the end has little left to do); the rest is written normally."""
        dtype = np.dtype(dtype if dtype is not None else (parts[0].dtype if parts else np.float32))
        views = [memoryview(np.ascontiguousarray(p, dtype=dtype)).cast("B") for p in parts if p.size]
        nbytes = sum(len(v) for v in views)
        if nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"{name}: {nbytes} bytes do not make an array of {tuple(shape)} {dtype}")
        path = self.tmp / name
        crc = _CRC.submit(_crc32, views) if nbytes >= _CRC_THREAD_MIN else None
        try:
            _write_file(path, views, direct=self.fsync, fsync=self.fsync)
        finally:
            checksum = crc.result() if crc is not None else _crc32(views)
        self.files[name] = {"bytes": nbytes, "crc32": checksum, "dtype": dtype.str,
                            "shape": list(shape)}

    def json(self, name: str, value: Any) -> None:
        data = json.dumps(value, sort_keys=True).encode()
        with open(self.tmp / name, "wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        self.files[name] = {"bytes": len(data), "crc32": zlib.crc32(data)}

    def commit(self, meta: dict[str, Any], *, keep_previous: bool = False) -> str:
        """Publish the entry and the new manifest; drop entries no chain needs any more."""
        final = self.root / self.name
        os.rename(self.tmp, final)
        if self.fsync:
            _fsync_dir(self.root)
        chain = [self.name] if self.kind == "full" else [*(self.manifest or {}).get("chain", []), self.name]
        if self.kind != "full" and not self.manifest:
            raise CheckpointError("an incremental checkpoint needs a full one before it")
        entries = dict((self.manifest or {}).get("entries", {}))
        entries[self.name] = {"kind": self.kind, "files": self.files, "meta": meta}
        entries = {name: entries[name] for name in chain}
        manifest = {"format": FORMAT, "seq": self.seq, "chain": chain, "entries": entries}
        tmp = self.root / f".tmp-{MANIFEST}-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(manifest, f, sort_keys=True)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.root / MANIFEST)
        if self.fsync:
            _fsync_dir(self.root)
        if not keep_previous:
            for path in self.root.iterdir():  # entries only: other files are not ours
                if _ENTRY.fullmatch(path.name) and path.name not in chain:
                    shutil.rmtree(path, ignore_errors=True)
        return self.name


def _remove_leftovers(root: Path, next_seq: int) -> None:
    """Remove what a writer that died mid-commit left in ``root``: its temporary files and
    directories, and entries numbered ``next_seq`` or later. Such an entry was renamed into
    place but its manifest never replaced the old one (killed between the two), so nothing
    names it, and the next commit needs its name."""
    for path in root.iterdir():
        entry = _ENTRY.fullmatch(path.name)
        if path.name.startswith(".tmp-") or (entry is not None and int(entry[1]) >= next_seq):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def read_manifest(root: Path, *, missing_ok: bool = False) -> dict[str, Any] | None:
    path = Path(root) / MANIFEST
    if not path.exists():
        if missing_ok:
            return None
        raise CheckpointError(f"no checkpoint in {root} (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown format {manifest.get('format')!r}")
    return manifest  # type: ignore[no-any-return]


def read_file(root: Path, entry: str, name: str, info: dict[str, Any]) -> bytes:
    data = (Path(root) / entry / name).read_bytes()
    if len(data) != info["bytes"] or zlib.crc32(data) != info["crc32"]:
        raise CheckpointError(f"{root}/{entry}/{name}: size or checksum mismatch (corrupt)")
    return data


def read_array(root: Path, entry: str, name: str, info: dict[str, Any]) -> np.ndarray:
    data = read_file(root, entry, name, info)
    return np.frombuffer(data, dtype=np.dtype(info["dtype"])).reshape(info["shape"]).copy()


def read_json(root: Path, entry: str, name: str, info: dict[str, Any]) -> Any:
    return json.loads(read_file(root, entry, name, info))


def has_checkpoint(root: Path) -> bool:
    return (Path(root) / MANIFEST).exists()
