"""A node in its own process, for the failure tests: it starts, says "ready", and serves.

    python tests/peer_node.py CLUSTER_JSON JOB TASK MODE

It binds only the loopback address the cluster spec gives it and runs until it is killed
(or until its parent's stdin closes, so it never outlives a crashed test run).
"""

from __future__ import annotations

import asyncio
import json
import sys

import rvz


async def main() -> None:
    cluster, job, task, mode = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    async with rvz.Node(cluster, job, task, mode, heartbeat=0.05, peer_timeout=5.0, linger=0.5):
        print("ready", rvz.implementation(), flush=True)
        loop = asyncio.get_running_loop()
        # Serve until killed, or until the parent goes away (stdin reaches EOF).
        await loop.run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    rvz.run(main())
