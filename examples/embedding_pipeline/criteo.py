"""The Criteo Display Advertising format: a streaming loader, feature encoding, and a cache.

A line is 40 tab-separated fields: the label (``0`` or ``1``), 13 integer features and 26
categorical features (hex strings, 32-bit in the published data); any feature may be empty.

Encoding (``Chunk``):

* categorical: the hex value is read as an integer (masked to 64 bits) and hashed with a
  per-field salt to a non-negative int64 id, so equal strings in different fields get
  different ids; an empty value is its field's own "missing" id;
* integer: ``log(1 + x)`` for ``x >= 0``, and ``-log(1 - x)`` for negative ``x`` (the
  published data has small negatives in one column; the transform is odd so they stay
  distinct from positives); an empty value reads as 0, like a zero count.

Bad lines (wrong field count, a label other than 0/1, a non-integer in an integer column,
a non-hex categorical value, undecodable bytes) are **skipped and counted** by default:
``LoadStats`` keeps the count and the first few line numbers with their reason. With
``strict=True`` the first bad line raises ``CriteoFormatError`` naming the file and the line
number. Blank lines are bad lines too. Gzip input is recognised by its magic bytes.

``encode(path, out_dir)`` streams a file into a column cache (``labels``, ``dense``, ``ids``
as raw little-endian arrays plus ``meta.json``); ``Columns.open(out_dir)`` maps it back, so
several worker processes read one parse of the file without copying it.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

NUM_INT = 13
NUM_CAT = 26
NUM_FIELDS = 1 + NUM_INT + NUM_CAT
MASK64 = (1 << 64) - 1
MISSING = MASK64            # the raw value of an empty categorical field (before hashing)
BAD_EXAMPLES = 10           # bad lines remembered (line number and reason) by LoadStats


class CriteoFormatError(ValueError):
    """A bad line in strict mode: names the file and the line number."""


@dataclass
class LoadStats:
    lines: int = 0
    samples: int = 0
    bad: int = 0
    bad_examples: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)

    def note_bad(self, line_no: int, reason: str) -> None:
        self.bad += 1
        if len(self.bad_examples) < BAD_EXAMPLES:
            self.bad_examples.append((line_no, reason))


@dataclass
class Chunk:
    """Encoded samples: ``labels`` float32 [n], ``dense`` float32 [n, 13], ``ids`` int64 [n, 26]."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def slice(self, start: int, stop: int) -> Chunk:
        return Chunk(self.labels[start:stop], self.dense[start:stop], self.ids[start:stop])


# -- encoding -------------------------------------------------------------------------------------

def mix64(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64's): uint64 -> well-spread uint64."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


FIELD_SALTS = mix64(np.arange(1, NUM_CAT + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))


def hash_categorical(raw: np.ndarray) -> np.ndarray:
    """Raw categorical values ``uint64 [n, 26]`` -> ids ``int64 [n, 26]`` (>= 0), per-field salted."""
    return (mix64(raw ^ FIELD_SALTS) >> np.uint64(1)).astype(np.int64)


def transform_integer(values: np.ndarray) -> np.ndarray:
    """Integer features (float64, NaN for empty) -> float32: odd log1p, empty as 0."""
    v = np.nan_to_num(values, nan=0.0)
    return (np.sign(v) * np.log1p(np.abs(v))).astype(np.float32)


def parse_line(line: bytes) -> tuple[int, list[float], list[int]]:
    """One line (without its newline) -> ``(label, 13 integers (NaN if empty), 26 raw values)``.

    Raises ``ValueError`` with the reason for a bad line.
    """
    parts = line.split(b"\t")
    if len(parts) != NUM_FIELDS:
        raise ValueError(f"{len(parts)} fields, expected {NUM_FIELDS}" if line.strip() else "empty line")
    label = parts[0]
    if label != b"0" and label != b"1":
        raise ValueError(f"label {label[:20]!r} is not 0 or 1")
    ints: list[float] = []
    for j in range(1, 1 + NUM_INT):
        p = parts[j]
        if not p:
            ints.append(float("nan"))
            continue
        try:
            ints.append(float(int(p)))
        except ValueError:
            raise ValueError(f"integer feature I{j}: {p[:20]!r} is not an integer") from None
    cats: list[int] = []
    for j in range(1 + NUM_INT, NUM_FIELDS):
        p = parts[j]
        if not p:
            cats.append(MISSING)
            continue
        try:
            v = int(p, 16)
        except ValueError:
            raise ValueError(f"categorical feature C{j - NUM_INT}: {p[:20]!r} is not hex") from None
        if v < 0:
            raise ValueError(f"categorical feature C{j - NUM_INT}: {p[:20]!r} is negative")
        cats.append(v & MASK64)
    return label == b"1", ints, cats


def open_input(path: str | os.PathLike[str]) -> IO[bytes]:
    """The file's bytes, gunzipped if it starts with the gzip magic."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def read_chunks(path: str | os.PathLike[str], chunk_size: int = 8192, *, strict: bool = False,
                stats: LoadStats | None = None) -> Iterator[Chunk]:
    """Stream ``path`` as encoded chunks of up to ``chunk_size`` good samples (the last may be
    shorter); memory stays bounded by one chunk. Bad lines: see the module doc."""
    stats = stats if stats is not None else LoadStats()
    labels = np.empty(chunk_size, dtype=np.float32)
    ints = np.empty((chunk_size, NUM_INT), dtype=np.float64)
    cats = np.empty((chunk_size, NUM_CAT), dtype=np.uint64)
    n = 0

    def flush() -> Chunk:
        return Chunk(labels[:n].copy(), transform_integer(ints[:n]), hash_categorical(cats[:n]))

    with open_input(path) as f:
        for line_no, raw in enumerate(f, start=1):
            stats.lines = line_no
            line = raw.rstrip(b"\n").rstrip(b"\r")
            try:
                label, row_ints, row_cats = parse_line(line)
            except ValueError as exc:
                if strict:
                    raise CriteoFormatError(f"{os.fspath(path)}:{line_no}: bad line: {exc}") from None
                stats.note_bad(line_no, str(exc))
                continue
            labels[n] = label
            ints[n] = row_ints
            cats[n] = row_cats
            n += 1
            stats.samples += 1
            if n == chunk_size:
                yield flush()
                n = 0
    if n:
        yield flush()


def read_batches(path: str | os.PathLike[str], batch_size: int, *, strict: bool = False,
                 stats: LoadStats | None = None, drop_last: bool = False) -> Iterator[Chunk]:
    """Stream ``path`` as batches of exactly ``batch_size`` samples (the last may be short
    unless ``drop_last``)."""
    pending: list[Chunk] = []
    have = 0
    for chunk in read_chunks(path, max(batch_size, 4096), strict=strict, stats=stats):
        pending.append(chunk)
        have += len(chunk)
        if have < batch_size:
            continue
        joined = concat(pending)
        full = len(joined) // batch_size * batch_size
        for start in range(0, full, batch_size):
            yield joined.slice(start, start + batch_size)
        rest = joined.slice(full, len(joined))
        pending, have = ([rest], len(rest)) if len(rest) else ([], 0)
    if have and not drop_last:
        yield concat(pending)


def concat(chunks: list[Chunk]) -> Chunk:
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(np.concatenate([c.labels for c in chunks]), np.concatenate([c.dense for c in chunks]),
                 np.concatenate([c.ids for c in chunks]))


# -- the column cache ---------------------------------------------------------------------------------

COLUMNS = (("labels", np.float32, ()), ("dense", np.float32, (NUM_INT,)), ("ids", np.int64, (NUM_CAT,)))


@dataclass
class Columns:
    """A whole encoded file as (memory-mapped) arrays."""

    labels: np.ndarray
    dense: np.ndarray
    ids: np.ndarray
    meta: dict

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, start: int, stop: int) -> Chunk:
        """Samples ``[start, stop)`` as a chunk of in-memory arrays."""
        return Chunk(np.array(self.labels[start:stop]), np.array(self.dense[start:stop]),
                     np.array(self.ids[start:stop]))

    @staticmethod
    def open(directory: str | os.PathLike[str]) -> Columns:
        root = Path(directory)
        meta = json.loads((root / "meta.json").read_text())
        n = int(meta["samples"])
        arrays = {}
        for name, dtype, shape in COLUMNS:
            if n == 0:
                arrays[name] = np.zeros((0, *shape), dtype=dtype)
            else:
                arrays[name] = np.memmap(root / f"{name}.bin", dtype=dtype, mode="r", shape=(n, *shape))
        return Columns(arrays["labels"], arrays["dense"], arrays["ids"], meta)


def encode(path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, strict: bool = False,
           extra_meta: dict | None = None) -> LoadStats:
    """Stream ``path`` into the column cache ``out_dir``; returns the load statistics.

    ``meta.json`` is written last (under a temporary name, then renamed): a cache without it
    is incomplete.
    """
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "meta.json").unlink(missing_ok=True)
    stats = LoadStats()
    files = {name: open(root / f"{name}.bin", "wb") for name, _, _ in COLUMNS}
    try:
        for chunk in read_chunks(path, 65536, strict=strict, stats=stats):
            for name, dtype, _ in COLUMNS:
                files[name].write(np.ascontiguousarray(getattr(chunk, name), dtype=dtype).tobytes())
    finally:
        for f in files.values():
            f.close()
    meta = {"source": os.path.basename(os.fspath(path)), "samples": stats.samples, "lines": stats.lines,
            "bad": stats.bad, "bad_examples": stats.bad_examples, **(extra_meta or {})}
    tmp = root / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, root / "meta.json")
    return stats
