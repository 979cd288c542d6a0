"""The locked-memory limit that RDMA registration runs into, checked before registering.

Registering memory with an RDMA device pins its pages, and the kernel counts pinned pages
against ``RLIMIT_MEMLOCK`` (``ulimit -l``).  Past it ``ibv_reg_mr`` fails with a bare
``ENOMEM``/``EPERM``; rvz checks first and says which limit and how to raise it.
"""

from __future__ import annotations

import resource

from ..errors import TransportError

CAP_IPC_LOCK = 14

HOW_TO_RAISE = (
    "raise it: `ulimit -l unlimited` in the shell that starts the process (the hard limit "
    "must allow it), a `<user> - memlock unlimited` line in /etc/security/limits.conf (new "
    "login), `LimitMEMLOCK=infinity` for a systemd service, or `docker run --ulimit "
    "memlock=-1` for a container")


def has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory past the limit (``CAP_IPC_LOCK``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def memlock_limit() -> tuple[int, int]:
    """``(soft, hard)`` of ``RLIMIT_MEMLOCK`` in bytes; ``resource.RLIM_INFINITY`` = unlimited."""
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)


def _fmt(n: int) -> str:
    if n == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{n} bytes ({n / (1 << 20):.1f} MiB)"


def check_memlock(already: int, more: int, what: str = "memory") -> None:
    """Raise ``TransportError`` if pinning ``more`` bytes on top of ``already`` would exceed
    ``RLIMIT_MEMLOCK``."""
    soft, hard = memlock_limit()
    if soft == resource.RLIM_INFINITY or already + more <= soft:
        return
    if has_cap_ipc_lock():
        return
    raise TransportError(
        f"cannot register {more} bytes of {what} for RDMA: with {already} bytes already "
        f"registered this exceeds RLIMIT_MEMLOCK, the max locked memory (`ulimit -l`), "
        f"which is {_fmt(soft)} (hard limit {_fmt(hard)}); {HOW_TO_RAISE}")
