"""The handshake: what a node says in its HELLO, and its verdict on a peer's HELLO and AUTH.

Sans-IO: ``Handshake`` reads the fields of the frames a peer sent and returns what to do
next (a checked ``Hello`` that says whether an AUTH must be answered), or raises the error
that refuses the connection (``ProtocolError`` or ``AuthError``).  It never touches a
socket: ``rvz.node`` writes the frames and binds the connection to its peer; the tests in
tests/test_handshake.py drive every verdict without one.

With a secret, each side proves it holds it by an HMAC bound to both fresh nonces, both
identities and incarnations, and the side it speaks from (see ``Handshake.proof``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _impl
from .errors import AuthError, ProtocolError

TaskId = tuple[str, int]

NONCE_SIZE = 16
# Replaced incarnations of each task remembered, to refuse a second process run as that task.
REPLACED_KEPT = 16


def task_name(task_id: TaskId) -> str:
    """How messages name a task (as ``Peer.name`` does)."""
    return f"/job:{task_id[0]}/replica:0/task:{task_id[1]}"


def certificate_names(job: str, task: int) -> set[str]:
    """The names a TLS certificate may give a task with ``tls_identity``: as a CN or a DNS
    or URI subject alternative name, ``/job:worker/task:2`` or ``worker-2``."""
    return {f"/job:{job}/task:{task}", f"{job}-{task}"}


def check_certificate(cert: dict[str, Any] | None, task_id: TaskId) -> None:
    """With ``tls_identity``, a peer's certificate must name the task it claims: its
    subject's CN or one of its DNS or URI subject alternative names (as
    ``ssl.SSLSocket.getpeercert()`` decodes them) is one of ``certificate_names``."""
    wanted = certificate_names(*task_id)
    names: list[str] = []
    if cert:
        names = [value for rdn in cert.get("subject", ()) for name, value in rdn
                 if name == "commonName"]
        names += [value for kind, value in cert.get("subjectAltName", ())
                  if kind in ("DNS", "URI")]
    if not wanted.intersection(names):
        raise AuthError(f"{task_name(task_id)}'s TLS certificate does not name it "
                        f"(tls_identity): it names {sorted(names)[:8]}, not one of "
                        f"{sorted(wanted)}")


@dataclass(frozen=True)
class Hello:
    """A peer's HELLO, checked.  ``proof`` is the AUTH this node answers with (a secret is
    in use: the peer is accepted once its own AUTH checks out); None when the peer is
    accepted on its HELLO alone."""

    task: TaskId
    incarnation: int
    window: int      # its push_window option
    parks: int       # its max_parked option
    nonce: bytes
    mode: str
    fields: dict[str, Any]  # the whole HELLO (one-sided offers read it)
    proof: bytes | None


class Handshake:
    """One node's side of every handshake: its identity, its secret, and the incarnations
    of each peer that newer ones replaced."""

    def __init__(self, task_id: TaskId, incarnation: int, secret: bytes | None, *,
                 default_window: int, default_parks: int,
                 in_cluster: Callable[[TaskId], bool]) -> None:
        self.task_id = task_id
        self.incarnation = incarnation
        self._secret = secret  # only the HMAC key: never logged, never in a message
        self._default_window = default_window
        self._default_parks = default_parks
        self._in_cluster = in_cluster
        self._replaced: dict[TaskId, deque[int]] = {}

    @property
    def has_secret(self) -> bool:
        return self._secret is not None

    def hello(self, **fields: Any) -> tuple[bytes, dict[str, Any]]:
        """A fresh nonce and the fields of our HELLO (``fields`` adds the node's options)."""
        nonce = os.urandom(NONCE_SIZE)
        job, task = self.task_id
        return nonce, {"v": _impl.codec.VERSION, "job": job, "task": task,
                       "inc": self.incarnation, "order": sys.byteorder, "n": nonce,
                       "auth": self._secret is not None, **fields}

    def on_hello(self, fields: dict[str, Any], *, dialled: TaskId | None,
                 our_nonce: bytes, address: str = "") -> Hello:
        """The verdict on a peer's HELLO: the checked ``Hello``, or the error that refuses
        it.  ``dialled`` is the task we dialled at ``address`` (None on a connection we
        accepted)."""
        try:
            version = fields["v"]
            task_id = (str(fields["job"]), int(fields["task"]))
            incarnation = int(fields["inc"])
            order = fields.get("order", "little")
            window = int(fields.get("win", self._default_window))
            parks = int(fields.get("park", self._default_parks))
            nonce = fields.get("n", b"")
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ProtocolError(f"HELLO is missing fields or has malformed ones: {fields!r}") from None
        if version != _impl.codec.VERSION:
            raise ProtocolError(f"peer speaks protocol version {version}, "
                                f"we speak {_impl.codec.VERSION}")
        if order != sys.byteorder:
            raise ProtocolError(f"peer is {order}-endian, this node is {sys.byteorder}-endian")
        if (not 0 <= incarnation < 1 << 64 or window < 0 or not 0 <= parks < 1 << 63
                or not isinstance(nonce, bytes)):
            raise ProtocolError(f"HELLO has out-of-range fields: {fields!r}")
        name = task_name(task_id)
        if task_id == self.task_id:
            # No node connects to itself (its own keys never leave it): such a HELLO is a
            # peer replaying ours, to have our own proof accepted as its own.
            raise ProtocolError(f"a peer claims to be this node ({name})")
        if dialled is not None and dialled != task_id:
            raise ProtocolError(f"dialled {task_name(dialled)} at {address} but {name} answered")
        if dialled is None and not self._in_cluster(task_id):
            raise ProtocolError(f"{name} is not in our cluster")
        mode = _impl.engine.canonical_mode(str(fields.get("mode", "")))
        wants_auth = bool(fields.get("auth", False))
        proof = None
        if self._secret is None and wants_auth:
            raise AuthError(f"{name} requires a secret and this node has none "
                            "(give both Node(secret=...) or RVZ_SECRET)")
        if self._secret is not None:
            if not wants_auth:
                raise AuthError(f"{name} has no secret and this node requires one")
            if len(nonce) != NONCE_SIZE or nonce == our_nonce:  # ours sent back: a reflection
                raise ProtocolError("HELLO carries a malformed nonce")
            proof = self.proof(dialled is not None, our_nonce, nonce, self.task_id,
                               self.incarnation, task_id, incarnation)
        return Hello(task_id, incarnation, window, parks, nonce, mode, fields, proof)

    def on_auth(self, hello: Hello | None, fields: dict[str, Any], *, dialled: bool,
                our_nonce: bytes) -> None:
        """The verdict on a peer's AUTH, the answer to ``hello`` on a connection we
        ``dialled`` or accepted: returns when its proof checks out, else refuses it."""
        if self._secret is None or hello is None or hello.proof is None:
            raise ProtocolError("unexpected AUTH frame")
        mac = fields.get("mac")
        # The peer's side is the other one: it dialled if we accepted.
        expected = self.proof(not dialled, hello.nonce, our_nonce, hello.task,
                              hello.incarnation, self.task_id, self.incarnation)
        if not isinstance(mac, bytes) or not hmac.compare_digest(mac, expected):
            raise AuthError(f"authentication of {task_name(hello.task)} failed: its proof "
                            "does not match this node's secret")

    # -- on a connection of the engine (a ``Wire``) -------------------------------------------

    def hello_on(self, core: Any, conn: Any, fields: dict[str, Any],
                 accept: Callable[[Any], None]) -> None:
        """A peer's HELLO on ``conn``, a connection of ``core``: the verdict binds the
        connection to its peer, then either ``accept``s it now or answers with our AUTH
        (``conn.nonce`` is the one our HELLO sent)."""
        dialled = conn.peer if conn.outbound else None
        hello = self.on_hello(fields, dialled=None if dialled is None else dialled.id,
                              our_nonce=conn.nonce,
                              address="" if dialled is None else dialled.address)
        if dialled is None:
            core.identified(conn, hello.task)
        conn.hello = hello
        if hello.proof is None:
            accept(conn)
        else:
            conn.write_frame(_impl.codec.encode_auth(hello.proof))

    def auth_on(self, conn: Any, fields: dict[str, Any], accept: Callable[[Any], None]) -> None:
        """A peer's AUTH on ``conn``: ``accept`` it once its proof checks out."""
        if conn.ready:
            raise ProtocolError("unexpected AUTH frame")
        self.on_auth(conn.hello, fields, dialled=conn.outbound, our_nonce=conn.nonce)
        accept(conn)

    def proof(self, dialled: bool, sender_nonce: bytes, receiver_nonce: bytes,
              sender: TaskId, sender_inc: int, receiver: TaskId, receiver_inc: int) -> bytes:
        """HMAC-SHA256 of the secret over the sender's side of the connection (it dialled,
        or it accepted), both fresh nonces and both identities.

        The side is what makes a proof one-way: without it, a node's proof to a peer on one
        connection is the very proof that node expects from that peer on another, and
        someone without the secret who dials both (handing each the other's nonce) could
        pass one's proof to the other as its own.
        """
        assert self._secret is not None
        message = b"".join((b"rvz-auth-2", b"D" if dialled else b"A", sender_nonce, receiver_nonce,
                            f"{sender[0]}:{sender[1]}:{sender_inc}".encode(),
                            f"{receiver[0]}:{receiver[1]}:{receiver_inc}".encode()))
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    # -- incarnations ------------------------------------------------------------------------

    def check_replaced(self, task_id: TaskId, incarnation: int, current: int | None,
                       current_connected: bool) -> None:
        """Refuse an incarnation of ``task_id`` that a newer one (``current``) replaced while
        that newer one is connected; take it back when the newer one is not.

        A restarted process never comes back, so an old incarnation that completes a
        handshake is alive: a second process run as the same task, or the real process after
        something claimed its identity with a new incarnation.  While the newer one is
        connected the old one is refused, so two live processes are not taken in turns.  Once
        the newer one is gone, the old one (proving itself, with a secret, by the secret) is
        taken back: refusing it for good would lock the real process out after an impostor
        left.  A newcomer is never refused: a restart whose old process is frozen, not dead,
        must not wait for that one's connection to time out."""
        replaced = self._replaced.get(task_id)
        if replaced is None or incarnation not in replaced:
            return
        if current_connected:
            assert current is not None
            name = task_name(task_id)
            raise AuthError(f"{name} incarnation {incarnation:#x} was replaced by incarnation "
                            f"{current:#x}: two processes run as {name} (give each task its "
                            "own job and task index)")
        replaced.remove(incarnation)  # taken back: the newer one goes in its place

    def replaced_of(self, task_id: TaskId) -> tuple[int, ...]:
        """The incarnations of ``task_id`` that newer ones replaced (the last few)."""
        return tuple(self._replaced.get(task_id, ()))

    def replaced(self, task_id: TaskId, old: int) -> None:
        """Incarnation ``old`` of ``task_id`` was replaced by a newer one."""
        self._replaced.setdefault(task_id, deque(maxlen=REPLACED_KEPT)).append(old)
