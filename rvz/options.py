"""A node's options, checked: ``Options`` fails with ``ConfigError`` naming the first bad one.

``rvz.Node`` takes its options as keyword arguments (it documents each) and keeps them in an
``Options``; everything here is checked before the node makes anything.
"""

from __future__ import annotations

import os
import ssl as _ssl
from dataclasses import dataclass, field
from typing import Any

from . import _impl
from .errors import ConfigError
from .poll import check_budget

MODES = ("recv", "send")
TRANSPORTS = ("tcp", "shm", "verbs", "auto")  # all but tcp: rvz.onesided

# The default of ``min_rate``: the slowest a large payload may arrive, in bytes/s on average,
# once it has taken peer_timeout.  Half a megabit per second is below any link tensors are
# exchanged over, even one shared by many connections, so a working link is never cut; a
# peer that trickles a payload to keep its connection and its reserved array is closed
# after peer_timeout + size / MIN_RATE at most, and has to send real bytes meanwhile.
MIN_RATE = 64 << 10

# Bytes a secret must have at least.  An AUTH frame is an HMAC over nonces anyone on the
# path sees, so one captured handshake lets a guesser test keys offline at full speed:
# 16 bytes (128 bits of a random key) put that out of reach; an empty key proves nothing.
SECRET_MIN_BYTES = 16


def check_secret(secret: str | bytes | None) -> bytes | None:
    """``secret=`` (or ``RVZ_SECRET`` when it is None) as the HMAC key, or None: no secret.
    A set ``RVZ_SECRET`` counts even when empty: an empty key would prove nothing."""
    where = "secret"
    if secret is None:
        secret = os.environ.get("RVZ_SECRET")
        where = "RVZ_SECRET"
        if secret is None:
            return None
    if not isinstance(secret, (str, bytes)):
        raise ConfigError(f"secret must be str or bytes, not {type(secret).__name__}")
    key = secret.encode("utf-8") if isinstance(secret, str) else secret
    if len(key) < SECRET_MIN_BYTES:
        raise ConfigError(f"{where} must be at least {SECRET_MIN_BYTES} bytes long (a random "
                          f"key: 16 bytes of os.urandom, or secrets.token_hex(16)), not "
                          f"{len(key)}")
    return key


@dataclass(frozen=True)
class Options:
    """Every option of a node but its cluster, job and task, checked.  ``secret`` becomes
    the HMAC key (``RVZ_SECRET`` when None), ``incarnation`` an int, and ``ssl`` the pair
    ``ssl_server``, ``ssl_client``.  The names are ``rvz.types.NodeOptions``'s, which types
    them as keywords (tests/test_options.py holds the two lists and ``Node``'s equal)."""

    mode: Any
    transport: Any
    host: str | None
    connect_timeout: float
    heartbeat: float
    peer_timeout: float
    linger: float
    push_window: int
    hold_limit: int
    lost_hold_limit: int | None
    claim_timeout: float | None
    incarnation: int | None
    max_payload: int
    recv_pool: int
    onesided: dict[str, Any] | None
    shm_copy: bool
    secret: Any = field(repr=False)  # the HMAC key: never printed
    ssl: Any
    max_parked: int
    max_steps: int
    step_idle: float | None
    hello_timeout: float
    max_unidentified: int
    answer_backlog: int
    busy_poll: float
    min_rate: int
    tls_identity: bool
    ssl_server: _ssl.SSLContext | None = field(init=False)
    ssl_client: _ssl.SSLContext | None = field(init=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be 'recv' or 'send', not {self.mode!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, not {self.transport!r}")
        if not 0 < self.heartbeat < self.peer_timeout:
            raise ConfigError(f"need 0 < heartbeat < peer_timeout, got heartbeat={self.heartbeat} "
                              f"and peer_timeout={self.peer_timeout}")
        self._check_sizes()
        self._check_durations()
        try:
            check_budget(self.busy_poll)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not isinstance(self.shm_copy, bool):
            raise ConfigError(f"shm_copy must be True or False, not {self.shm_copy!r}")
        if self.onesided is not None:
            # Checked here, as every other option is, so that an unknown name or a bad value
            # fails the constructor, whatever the transport.
            from .onesided.engine import Options as OnesidedOptions
            try:
                OnesidedOptions(self.onesided)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"onesided: {exc}") from None
        if self.incarnation is not None:
            # The HELLO carries it as 64 bits: any other value fails every connection later.
            number = _impl.keys.as_index(self.incarnation)
            if number is None or not 0 <= number < 1 << 64:
                raise ConfigError(f"incarnation must be an int in [0, 2**64), not "
                                  f"{self.incarnation!r}")
            object.__setattr__(self, "incarnation", number)
        object.__setattr__(self, "secret", check_secret(self.secret))
        self._check_tls()

    def _check_sizes(self) -> None:
        for name in ("push_window", "hold_limit", "max_payload", "recv_pool", "max_parked",
                     "max_steps", "max_unidentified", "answer_backlog", "min_rate",
                     "lost_hold_limit"):
            value = getattr(self, name)
            if name == "lost_hold_limit" and value is None:
                continue
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a number of bytes >= 0, not {value!r}")

    def _check_durations(self) -> None:
        for name in ("connect_timeout", "linger", "hello_timeout", "step_idle", "claim_timeout"):
            seconds = getattr(self, name)
            if seconds is None and name in ("step_idle", "claim_timeout"):
                continue
            if not seconds >= 0:
                raise ConfigError(f"{name} must be >= 0 seconds, not {seconds!r}")

    def _check_tls(self) -> None:
        server, client = self.ssl if isinstance(self.ssl, tuple) else (self.ssl, self.ssl)
        for ctx in (server, client):
            if ctx is not None and not isinstance(ctx, _ssl.SSLContext):
                raise ConfigError("ssl must be an ssl.SSLContext or a (server, client) pair of them")
        if self.tls_identity and (server is None or client is None
                                  or server.verify_mode != _ssl.CERT_REQUIRED
                                  or client.verify_mode != _ssl.CERT_REQUIRED):
            raise ConfigError("tls_identity needs mutual TLS: ssl= contexts that both require "
                              "the peer's certificate (verify_mode = ssl.CERT_REQUIRED)")
        object.__setattr__(self, "ssl_server", server)
        object.__setattr__(self, "ssl_client", client)
