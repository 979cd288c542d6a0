"""A user program on rvz's whole public API, checked with mypy --strict."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

import rvz
from rvz.cluster import from_env

if TYPE_CHECKING:
    from typing_extensions import assert_type

log = logging.getLogger(__name__)


def make_keys() -> tuple[rvz.Key, rvz.Key]:
    src = "/job:worker/replica:0/task:0/device:CPU:0"
    dst = "/job:ps/replica:0/task:0/device:CPU:0"
    key = rvz.Key(src=src, dst=dst, name="emb_0", frame=0, iter=0, incarnation=1)
    again = rvz.Key.parse(str(key))
    if TYPE_CHECKING:
        assert_type(again, rvz.Key)
        assert_type(key.name, str)
        assert_type(key.frame, int)
    job, task = rvz.parse_device(src)
    assert job == "worker" and task == 0 and key == again
    return key, rvz.Key(src, dst, "grad")


def as_array(value: rvz.Value) -> npt.NDArray[np.float32]:
    if isinstance(value, bytes):
        return np.frombuffer(value, dtype=np.float32)
    return np.asarray(value, dtype=np.float32)


async def local(key: rvz.Key) -> float:
    rv = rvz.Rendezvous()
    rv.send(key, np.ones(4, dtype=np.float32))
    rv.send_many([(key, b"\x00" * 8)])
    first = await rv.recv(key, timeout=1.0)
    if TYPE_CHECKING:
        assert_type(first, rvz.Value)
    rest: list[rvz.Value] = await rv.recv_many([str(key)], timeout=1.0)
    queued, waiting = rv.pending(key)
    rv.abort(RuntimeError("done"))
    assert rv.aborted and queued == 0 and waiting == 0
    return float(as_array(first).sum()) + len(rest)


async def producer(cluster: rvz.ClusterSpec, key: rvz.Key, mode: rvz.Mode,
                   transport: rvz.TransportName) -> None:
    async with rvz.Node(cluster, job="worker", task=0, mode=mode, transport=transport) as node:
        value: rvz.SendValue = np.arange(8, dtype=np.float32)
        await node.send(key, value, timeout=5.0)
        await node.send(str(key), b"raw", mode="send")
        # (mypy 2 no longer takes a bytearray or memoryview for bytes: SendValue names them)
        await node.send(key, bytearray(b"raw"))
        await node.send(key, memoryview(b"raw"))
        await node.send_many([(key, np.zeros(2))], step=0)
        step: rvz.Step = node.step(7)
        await step.send(key, np.float32(1.5))
        await step.send_many([(key, b"x")])
        name: str = node.transport_for("/job:ps/replica:0/task:0")
        log.info("%r uses %s, state %s", node, name, node.state)


async def consumer(cluster: rvz.ClusterSpec, key: rvz.Key) -> float:
    node = rvz.Node(cluster, "ps", 0, "send", connect_timeout=5.0, claim_timeout=None)
    await node.start()
    try:
        got = await node.recv(key, timeout=5.0)
        if TYPE_CHECKING:
            assert_type(got, rvz.Value)
        more: list[rvz.Value] = await node.recv_many([key, key], mode="recv")
        buf: npt.NDArray[np.float32] = np.zeros(4, np.float32)
        into = await node.recv(key, into=buf)  # the caller's own buffer comes back as it went
        if TYPE_CHECKING:
            assert_type(into, npt.NDArray[np.float32])
        filled: list[object] = await node.recv_many([key, key], into=[buf, None])
        step = node.step(7)
        in_step: rvz.Value = await step.recv(key)
        in_buffer: bytearray = await step.recv(key, into=bytearray(8))
        both: list[rvz.Value] = await step.recv_many([key])
        await step.cleanup("finished")
        await node.cleanup_step(8)
        return (float(as_array(got).sum()) + len(more) + as_array(in_step).size + len(both)
                + into.size + len(filled) + len(in_buffer))
    except (rvz.Aborted, rvz.PeerLost, rvz.RemoteError) as exc:
        log.warning("failed: %s", exc)
        raise
    except (rvz.WrongEndpoint, rvz.KeyFormatError, rvz.ProtocolError, rvz.TransportError,
            rvz.ConfigError, rvz.AuthError) as exc:
        raise rvz.RvzError(str(exc)) from exc
    finally:
        node.abort(rvz.NodeClosed("bye"))
        await node.close()


def counters(node: rvz.Node) -> tuple[int, int, str | None, float]:
    """Node.stats() is typed to its last field: read without casts under --strict."""
    stats = node.stats()
    sent = sum(peer["bytes_out"] for peer in stats["peers"].values())
    waiting = sum(step["waiting_recvs"] for step in stats["steps"].values())
    transport = next(iter(stats["peers"].values()))["transport"] if stats["peers"] else None
    poll = stats["busy_poll"]
    return sent + stats["waits"]["producer"], waiting + stats["held"]["bytes"], transport, (
        poll["budget"] if poll is not None else 0.0)


def producer_waits(node: rvz.Node) -> int:
    return node.stats()["waits"]["producer"]  # an int, not Any (no-any-return)


def main() -> None:
    key, _ = make_keys()
    cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})
    also = rvz.ClusterSpec({"worker": ["127.0.0.1:7001"]})
    address: str = also.address("worker", 0)
    pairs: list[tuple[str, int]] = cluster.tasks()
    try:
        env_cluster, job, task = from_env()
        env_node: rvz.Node = rvz.Node.from_env(mode="send", max_steps=1024, secret=None)
        step: rvz.Step = env_node.new_step()
        log.info("%s %d", env_node, step.id)
        tf = rvz.ClusterSpec.from_tf_config()
        log.info("%s %s %d %s", env_cluster, job, task, tf)
    except rvz.ConfigError:
        pass
    total: float = rvz.run(local(key), loop="asyncio")
    loop = rvz.new_event_loop("auto")
    loop.close()
    log.info("%s %s %s %s %s", address, pairs, total, rvz.implementation(), rvz.loop_name)
    rvz.run(producer(cluster, key, "recv", "tcp"))
    result: float = rvz.run(consumer(cluster, key))
    log.info("%s %s", result, rvz.__version__)


if __name__ == "__main__":
    asyncio.run(asyncio.sleep(0))
    main()
