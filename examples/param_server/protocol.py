"""The wire protocol between workers and PS shards, as rvz keys.

Every message travels on its own key, one per edge and step:
``src device ; 0 ; dst device ; kind ; 0:step`` (the step is the key's ``iter``), where the
devices name the worker task and the shard task. A key is used exactly once, so values never
queue behind each other on a key, and the table forgets a key as soon as it is received.

Per (worker, shard) there are two independent channels, each numbering its own steps from 0:

* lookup: worker -> shard ``LOOKUP_IDS`` (int64 ``[n]``, unique, owned by the shard);
  shard -> worker ``LOOKUP_ROWS`` (float32 ``[n, dim]``).
* push: worker -> shard ``PUSH_IDS`` (int64 ``[n]``) and ``PUSH_GRADS`` (float32 ``[n, dim]``);
  shard -> worker ``PUSH_ACK`` (int64 ``[global_step, version]`` after the update).

They are separate so that a worker can look up step t+2 while its push of step t is still
in flight (the embedding pipeline's prefetch). A worker sends a lookup and a push to every
shard at every step, with empty arrays if it has no ids there: the shard's replicated hot
state counts pushes. ``END`` (the bytes ``b"end"``) in place of the ids closes a channel.

All nodes of a cluster should use the same rvz mode (the demos' ``--mode`` sets it for every
process). Mixed modes still deliver, but a Recv-Driven producer whose consumer waits
Send-Driven holds each value until rvz's ``claim_timeout`` pushes it: 2-3 s per message.
"""

from __future__ import annotations

from typing import Any

import rvz

PS_JOB = "ps"
WORKER_JOB = "worker"

LOOKUP_IDS = "emb_lookup_ids"
LOOKUP_ROWS = "emb_lookup_rows"
PUSH_IDS = "emb_push_ids"
PUSH_GRADS = "emb_push_grads"
PUSH_ACK = "emb_push_ack"

TO_SHARD = (LOOKUP_IDS, PUSH_IDS, PUSH_GRADS)
TO_WORKER = (LOOKUP_ROWS, PUSH_ACK)

END = b"end"


def device(job: str, task: int) -> str:
    return f"/job:{job}/replica:0/task:{task}/device:CPU:0"


def edge(kind: str, worker: int, shard: int, step: int, worker_job: str = WORKER_JOB) -> rvz.Key:
    """The key of one message of ``kind`` between ``worker`` and ``shard`` at ``step``."""
    w, s = device(worker_job, worker), device(PS_JOB, shard)
    if kind in TO_SHARD:
        return rvz.Key(src=w, dst=s, name=kind, iter=step)
    if kind in TO_WORKER:
        return rvz.Key(src=s, dst=w, name=kind, iter=step)
    raise ValueError(f"unknown message kind {kind!r}")


def is_end(value: Any) -> bool:
    return isinstance(value, bytes) and value == END
