"""The wire protocol between workers and PS shards, as rvz keys and arrays.

Per (worker, shard) there are two channels, each numbering its clocks from 0:

* pull: worker -> shard ``PULL_IDS``, shard -> worker ``PULL_ROWS``;
* push: worker -> shard ``PUSH_IDS`` and ``PUSH_GRADS``, shard -> worker ``PUSH_ACK``;
* read: worker -> shard ``READ_IDS``, shard -> worker ``READ_ROWS``: a read-only lookup
  (evaluation) that takes no clock: it waits for no consistency bound, creates no row,
  counts no access, and reads an absent id as the initial row it would get. Its messages are
  numbered by their own sequence, in steps of their own (``read_step_id``).

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
answers ``REJOIN`` (frame = epoch) with the clocks it will continue at (pull, push, read),
then retries what it had in flight.

A worker restarted as a new process (the shard was started with ``worker_rejoin``, asp or
ssp): the shard greets the task again, ``[epoch, global steps..., generation, clock]`` with
the worker's next generation and the clock its pushes stand at (a first greeting says
generation 0). The new process continues at the largest of the shards' clocks, tells each
shard so with ``JOIN`` (iter 0), and from then on every key between them has the frame
``frame(epoch, generation)``: nothing the old process left unanswered is ever taken.
Under bsp the new process continues at the clock of its own journal instead (it replays),
and every process of the task first sends each shard ``KNOCK`` (frame 0, iter 0: a FIFO of
knocks) with a nonce of its own, which its ``JOIN`` repeats: a knock from a process the
shard does not serve tells it that the one it serves is gone, even before rvz reports the
loss (a shard that had nothing in flight with the dead process may not hear of it at once).

Replicas (tasks of the ``replica`` job) follow each shard by deltas: replica -> shard
``DELTA_ASK`` (iter = the replica's request number), ``[session, T, since_0, ...,
since_{T-1}]`` (the table versions its copy stands at; -1: send everything); shard ->
replica ``DELTA_META`` and ``DELTA_ROWS`` (frame = the session, a random number per replica
process, so that no answer meant for an earlier process of the task is ever taken), see
``pack_delta``. ``END`` instead of the ask closes the channel. A replica answers reads from
its copy: reader -> replica ``REPLICA_READ_IDS`` (iter = the reader's request number),
``[session, ids message of a read-only pull]``; replica -> reader ``REPLICA_READ_ROWS``
(frame = the session), see ``replica_edge``.

Ids travel as int64 ``[T, n_0, ..., n_{T-1}, ids of table 0, ids of table 1, ...]`` for the
T tables of the service (in their configured order), with ``-T`` for a read-only pull (an
evaluation read: absent ids read as zeros, no row is created); rows and gradients as one float32
array, the tables' ``[n_t, dim_t]`` blocks back to back.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import rvz

PS_JOB = "ps"
WORKER_JOB = "worker"
REPLICA_JOB = "replica"

PULL_IDS = "ps_pull_ids"
PULL_ROWS = "ps_pull_rows"
PUSH_IDS = "ps_push_ids"
PUSH_GRADS = "ps_push_grads"
PUSH_ACK = "ps_push_ack"
HELLO = "ps_hello"
REJOIN = "ps_rejoin"
JOIN = "ps_join"
KNOCK = "ps_knock"
READ_IDS = "ps_read_ids"
READ_ROWS = "ps_read_rows"
DELTA_ASK = "ps_delta_ask"
DELTA_META = "ps_delta_meta"
DELTA_ROWS = "ps_delta_rows"
REPLICA_READ_IDS = "replica_read_ids"
REPLICA_READ_ROWS = "replica_read_rows"

TO_SHARD = (PULL_IDS, PUSH_IDS, PUSH_GRADS, REJOIN, READ_IDS, DELTA_ASK, JOIN, KNOCK)
TO_WORKER = (PULL_ROWS, PUSH_ACK, HELLO, READ_ROWS, DELTA_META, DELTA_ROWS)

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


def replica_edge(kind: str, reader: int, replica: int, seq: int, session: int = 0,
                 reader_job: str = WORKER_JOB, replica_job: str = REPLICA_JOB) -> rvz.Key:
    """The key of one read between ``reader`` (a task of ``reader_job``) and ``replica``."""
    r, p = device(reader_job, reader), device(replica_job, replica)
    if kind == REPLICA_READ_IDS:
        return rvz.Key(src=r, dst=p, name=kind, frame=session, iter=seq)
    if kind == REPLICA_READ_ROWS:
        return rvz.Key(src=p, dst=r, name=kind, frame=session, iter=seq)
    raise ValueError(f"unknown replica message kind {kind!r}")


def frame(epoch: int, generation: int) -> int:
    """The frame of the keys between a shard at ``epoch`` and a worker's ``generation``-th
    process (0: the one the job started with)."""
    return epoch | generation << 24


def step_id(worker: int, clock: int) -> int:
    """The rvz step of ``worker``'s clock ``clock`` (step 0 is left to the handshake)."""
    return ((worker + 1) << 40) | clock


def read_step_id(worker: int, seq: int) -> int:
    """The rvz step of ``worker``'s read ``seq``: apart from its clocks' steps, so that the
    clean-up of a failed training step leaves a read alone."""
    return ((worker + 1) << 40) | (1 << 39) | seq


def is_end(value: Any) -> bool:
    return isinstance(value, bytes) and value == END


def pack_ids(parts: list[np.ndarray], create: bool = True) -> np.ndarray:
    """One ids message; ``create=False`` (a read-only pull) is sent as ``-T`` tables."""
    header = np.empty(1 + len(parts), dtype=np.int64)
    header[0] = len(parts) if create else -len(parts)
    header[1:] = [len(p) for p in parts]
    if len(parts) == 1:
        return np.concatenate([header, np.asarray(parts[0], dtype=np.int64)])
    return np.concatenate([header, *[np.asarray(p, dtype=np.int64) for p in parts]])


def unpack_ids(message: Any, num_tables: int) -> list[np.ndarray]:
    """The ids of each table (pushes; see ``unpack_pull`` for pulls)."""
    return unpack_pull(message, num_tables)[0]


def unpack_pull(message: Any, num_tables: int) -> tuple[list[np.ndarray], bool]:
    """The ids of each table, and whether absent ids may get rows (False: a read-only pull)."""
    if not isinstance(message, np.ndarray) or message.dtype != np.int64 or message.ndim != 1:
        raise ValueError(f"ids must be a 1-D int64 array, not {type(message).__name__} "
                         f"{getattr(message, 'dtype', '')}{list(getattr(message, 'shape', []))}")
    header = message[:1 + num_tables].tolist()  # Python ints: cheaper than numpy reductions
    tables = header[0] if header else 0
    if len(header) < 1 + num_tables or abs(tables) != num_tables:
        raise ValueError(f"ids message for {tables if header else '?'} tables, "
                         f"the service has {num_tables}")
    counts = header[1:]
    if min(counts, default=0) < 0 or 1 + num_tables + sum(counts) != len(message):
        raise ValueError("ids message: counts do not match its length")
    parts, start = [], 1 + num_tables
    for count in counts:
        parts.append(message[start:start + count])
        start += count
    return parts, tables > 0


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


# One table's part of a delta: (full, version, ids, whole rows, removed ids).
Delta = tuple[bool, int, np.ndarray, np.ndarray, np.ndarray]


def pack_delta(epoch: int, parts: list[Delta]) -> tuple[np.ndarray, np.ndarray]:
    """A shard's delta as (meta, rows): meta is int64 ``[epoch, T, (full, version, n, width,
    r) per table, then each table's n ids and r removed ids]``, rows float32, each table's
    ``[n, width]`` block back to back."""
    head = [epoch, len(parts)]
    for full, version, ids, rows, removed in parts:
        head += [int(full), version, len(ids), rows.shape[1] if rows.ndim == 2 else 0, len(removed)]
    meta = np.concatenate([np.asarray(head, dtype=np.int64),
                           *[np.concatenate([p[2], p[4]]).astype(np.int64) for p in parts]])
    return meta, pack_rows([p[3] for p in parts])


def unpack_delta(meta: Any, rows: Any) -> tuple[int, list[Delta]]:
    """(epoch, each table's part) of a delta; ValueError when it does not add up."""
    if not isinstance(meta, np.ndarray) or meta.dtype != np.int64 or meta.ndim != 1 or len(meta) < 2:
        raise ValueError("delta meta must be a 1-D int64 array")
    epoch, tables = int(meta[0]), int(meta[1])
    head = meta[2:2 + 5 * tables].reshape(-1, 5).tolist() if tables >= 0 else []
    if tables < 0 or len(head) != tables or min((min(h[2], h[3], h[4]) for h in head), default=0) < 0:
        raise ValueError("delta meta: bad table headers")
    if len(meta) != 2 + 5 * tables + sum(h[2] + h[4] for h in head):
        raise ValueError("delta meta: counts do not match its length")
    blocks = unpack_rows(rows, [h[2] for h in head], [h[3] for h in head])
    parts, start = [], 2 + 5 * tables
    for (full, version, n, _, r), block in zip(head, blocks, strict=True):
        parts.append((bool(full), version, meta[start:start + n], block, meta[start + n:start + n + r]))
        start += n + r
    return epoch, parts
