"""Mistakes mypy --strict must catch in a user program: each line marked ``# E: code``."""

from __future__ import annotations

import rvz

CLUSTER = rvz.ClusterSpec({"w": ["127.0.0.1:7001"]})
KEY = rvz.Key("/job:w/replica:0/task:0/device:CPU:0", "/job:w/replica:0/task:0/device:CPU:0", "t")


async def main() -> None:
    node = rvz.Node(CLUSTER, "w", 0, mode="pushh")  # E: arg-type
    rvz.Node(CLUSTER, "w", 0, transport="tpc")  # E: arg-type
    rvz.Node.from_env(mode="pushh")  # E: arg-type
    rvz.Node.from_env(max_stesp=4)  # E: call-arg
    await node.send(KEY, b"x", mode="sned")  # E: arg-type
    print(KEY.nmae)  # E: attr-defined
    count: int = await node.recv(KEY)  # E: assignment
    counts: list[int] = await node.recv_many([KEY])  # E: assignment
    local: int = await rvz.Rendezvous().recv(KEY)  # E: assignment
    filled: int = await node.recv(KEY, into=bytearray(4))  # E: arg-type
    rvz.run(main(), loop="uv")  # E: arg-type
    print(node.stats()["wiats"])  # E: typeddict-item
    print(count, counts, local, filled)
