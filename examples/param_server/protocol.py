"""The wire protocol between workers and PS shards, as rvz keys and arrays.

Per (worker, shard) there are two channels, each numbering its clocks from 0:

* pull: worker -> shard ``PULL_IDS``, shard -> worker ``PULL_ROWS``;
* push: worker -> shard ``PUSH_IDS`` and ``PUSH_GRADS``, shard -> worker ``PUSH_ACK``.

They are separate so that a worker can pull clock t+2 while its push of clock t is in
flight (the embedding pipeline's prefetch). A worker sends a pull and a push to every shard
at every clock, with no ids if it has none there: each shard counts every worker's clock
(consistency) and every push (the global step). ``END`` (``b"end"``) instead of the ids
closes a channel.

Every message of worker w's clock c runs in rvz step ``step_id(w, c)``: a worker that fails
mid-step cleans that step up (``node.step(id).cleanup()``) and every shard drops it.

A key is ``src ; dst ; kind ; epoch:clock`` (the key's frame is the shard's epoch, its iter
the clock), so each key is used once. A shard's epoch is 0 when it starts fresh and grows
by one each time it restarts from a checkpoint. On start, a shard sends ``HELLO`` (iter =
epoch) to every worker; a worker that sees the shard's next epoch (or loses the shard)
answers ``REJOIN`` (frame = epoch) with the clocks it will continue at, then retries what it
had in flight.

Ids travel as int64 ``[T, n_0, ..., n_{T-1}, ids of table 0, ids of table 1, ...]`` for the
T tables of the service (in their configured order); rows and gradients as one float32
array, the tables' ``[n_t, dim_t]`` blocks back to back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import rvz

PS_JOB = "ps"
WORKER_JOB = "worker"

PULL_IDS = "ps_pull_ids"
PULL_ROWS = "ps_pull_rows"
PUSH_IDS = "ps_push_ids"
PUSH_GRADS = "ps_push_grads"
PUSH_ACK = "ps_push_ack"
HELLO = "ps_hello"
REJOIN = "ps_rejoin"

TO_SHARD = (PULL_IDS, PUSH_IDS, PUSH_GRADS, REJOIN)
TO_WORKER = (PULL_ROWS, PUSH_ACK, HELLO)

END = b"end"


def device(job: str, task: int) -> str:
    return f"/job:{job}/replica:0/task:{task}/device:CPU:0"


def edge(kind: str, worker: int, shard: int, clock: int, epoch: int = 0,
         worker_job: str = WORKER_JOB) -> rvz.Key:
    """The key of one message of ``kind`` between ``worker`` and ``shard``."""
    w, s = device(worker_job, worker), device(PS_JOB, shard)
    if kind in TO_SHARD:
        return rvz.Key(src=w, dst=s, name=kind, frame=epoch, iter=clock)
    if kind in TO_WORKER:
        return rvz.Key(src=s, dst=w, name=kind, frame=epoch, iter=clock)
    raise ValueError(f"unknown message kind {kind!r}")


def step_id(worker: int, clock: int) -> int:
    """The rvz step of ``worker``'s clock ``clock`` (step 0 is left to the handshake)."""
    return ((worker + 1) << 40) | clock


def is_end(value: Any) -> bool:
    return isinstance(value, bytes) and value == END


def pack_ids(parts: list[np.ndarray]) -> np.ndarray:
    header = np.array([len(parts), *(len(p) for p in parts)], dtype=np.int64)
    return np.concatenate([header, *[np.asarray(p, dtype=np.int64) for p in parts]])


def unpack_ids(message: Any, num_tables: int) -> list[np.ndarray]:
    if not isinstance(message, np.ndarray) or message.dtype != np.int64 or message.ndim != 1:
        raise ValueError(f"ids must be a 1-D int64 array, not {type(message).__name__} "
                         f"{getattr(message, 'dtype', '')}{list(getattr(message, 'shape', []))}")
    if len(message) < 1 + num_tables or message[0] != num_tables:
        raise ValueError(f"ids message for {message[0] if len(message) else '?'} tables, "
                         f"the service has {num_tables}")
    counts = message[1:1 + num_tables]
    if counts.min(initial=0) < 0 or 1 + num_tables + counts.sum() != len(message):
        raise ValueError("ids message: counts do not match its length")
    bounds = np.cumsum(np.concatenate([[1 + num_tables], counts]))
    return [message[bounds[t]:bounds[t + 1]] for t in range(num_tables)]


def pack_rows(parts: list[np.ndarray]) -> np.ndarray:
    if len(parts) == 1:
        return np.ascontiguousarray(parts[0], dtype=np.float32).reshape(-1)
    return np.concatenate([np.asarray(p, dtype=np.float32).reshape(-1) for p in parts])


def unpack_rows(message: Any, counts: list[int], dims: list[int]) -> list[np.ndarray]:
    expected = sum(n * d for n, d in zip(counts, dims, strict=True))
    if not isinstance(message, np.ndarray) or message.dtype != np.float32 or message.size != expected:
        raise ValueError(f"rows message: expected {expected} float32 values, got "
                         f"{getattr(message, 'dtype', type(message).__name__)} "
                         f"{list(getattr(message, 'shape', []))}")
    flat = message.reshape(-1)
    out, start = [], 0
    for n, d in zip(counts, dims, strict=True):
        out.append(flat[start:start + n * d].reshape(n, d))
        start += n * d
    return out
