"""Hosts in Linux network namespaces, joined by veth pairs through a bridge, some links
rate-limited with ``tc ... tbf``: a few machines with real wire time, on one machine.

``hosts(names, slow={...})`` makes a switch namespace (a bridge) and one namespace per host,
each with an ``eth0`` on a private 10.23x.N.0/24 subnet that exists only inside them; a slow
host's link is shaped both ways (its egress and the switch port's egress). Everything made
is removed on exit, also on failure (deleting a namespace deletes its veth end, and the peer
goes with it). It needs root, ``ip`` and ``tc``; ``NamespacesUnavailable`` says why not.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class NamespacesUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``/``tc``, a container without rights)."""


@dataclass(frozen=True)
class Host:
    name: str        # the role it plays, e.g. "ps0"
    netns: str       # the namespace, for ``ip netns exec``
    address: str     # its eth0 address on the private subnet


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=15)


def prefix(netns: str) -> list[str]:
    """The command prefix that runs a program inside ``netns``."""
    return ["ip", "netns", "exec", netns]


@contextmanager
def hosts(names: list[str], slow: dict[str, str] | None = None,
          burst: str = "1mb", latency: str = "100ms") -> Iterator[dict[str, Host]]:
    """``{name: Host}``; ``slow`` maps a host name to its link's rate (``"1gbit"``)."""
    if os.geteuid() != 0:
        raise NamespacesUnavailable("network namespaces need root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise NamespacesUnavailable("no `ip` or `tc` binary")
    slow = slow or {}
    tag = f"{os.getpid() % 100000}{random.randrange(1000)}"
    subnet = f"10.232.{random.randrange(1, 250)}"
    switch = f"rvz{tag}sw"
    spaces = {name: f"rvz{tag}h{i}" for i, name in enumerate(names, 1)}
    made: list[str] = []
    try:
        try:
            for ns in [switch, *spaces.values()]:
                _sh("ip", "netns", "add", ns)
                made.append(ns)
            _sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", switch, "link", "set", "br0", "up")
            for i, (name, ns) in enumerate(spaces.items(), 1):
                _sh("ip", "link", "add", "name", "eth0", "netns", ns, "type", "veth",
                    "peer", "name", f"port{i}", "netns", switch)
                _sh("ip", "-n", switch, "link", "set", f"port{i}", "master", "br0", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{subnet}.{i}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                if name in slow:
                    for where, dev in ((ns, "eth0"), (switch, f"port{i}")):
                        _sh(*prefix(where), "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                            "rate", slow[name], "burst", burst, "latency", latency)
        except (subprocess.SubprocessError, OSError) as exc:
            err = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip()
            raise NamespacesUnavailable(f"cannot make network namespaces here: {exc} {err}") from exc
        yield {name: Host(name, ns, f"{subnet}.{i}") for i, (name, ns) in enumerate(spaces.items(), 1)}
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=15)
