"""The handshake's every verdict, without a socket: two ``Handshake`` objects exchange the
fields of their HELLO and AUTH frames by hand (rvz.handshake)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

import rvz
from rvz.handshake import REPLACED_KEPT, Handshake, Hello

from .conftest import in_loop

WORKER = ("worker", 0)
PS = ("ps", 0)
CLUSTER = {WORKER, PS, ("worker", 1)}
SECRET = b"s" * 16


def side(task_id: tuple[str, int] = WORKER, secret: bytes | None = None,
         incarnation: int = 1) -> Handshake:
    return Handshake(task_id, incarnation, secret, default_window=1 << 20, default_parks=64,
                     in_cluster=CLUSTER.__contains__)


def hello_of(hs: Handshake, **fields: Any) -> tuple[bytes, dict[str, Any]]:
    nonce, said = hs.hello(mode="recv", win=4096, park=8)
    return nonce, {**said, **fields}


def exchange(dialler: Handshake, listener: Handshake) -> tuple[Hello, Hello]:
    """A whole handshake: each reads the other's HELLO, then (with a secret) its AUTH.
    Returns (what the dialler read, what the listener read)."""
    d_nonce, d_fields = hello_of(dialler)
    l_nonce, l_fields = hello_of(listener)
    at_dialler = dialler.on_hello(l_fields, dialled=listener.task_id, our_nonce=d_nonce)
    at_listener = listener.on_hello(d_fields, dialled=None, our_nonce=l_nonce)
    if at_dialler.proof is not None:
        assert at_listener.proof is not None
        listener.on_auth(at_listener, {"mac": at_dialler.proof}, dialled=False, our_nonce=l_nonce)
        dialler.on_auth(at_dialler, {"mac": at_listener.proof}, dialled=True, our_nonce=d_nonce)
    return at_dialler, at_listener


@in_loop
def test_without_a_secret_a_hello_is_accepted_with_its_options() -> None:
    at_dialler, at_listener = exchange(side(WORKER, incarnation=7), side(PS, incarnation=9))
    assert at_dialler.proof is None and at_listener.proof is None
    assert (at_listener.task, at_listener.incarnation) == (WORKER, 7)
    assert (at_dialler.task, at_dialler.incarnation) == (PS, 9)
    assert (at_listener.window, at_listener.parks) == (4096, 8)
    assert at_listener.mode == "recv"


@in_loop
def test_a_hello_without_options_takes_the_defaults() -> None:
    listener = side(PS)
    nonce, fields = hello_of(side(WORKER))
    del fields["win"], fields["park"]
    hello = listener.on_hello(fields, dialled=None, our_nonce=b"")
    assert (hello.window, hello.parks) == (1 << 20, 64)


@in_loop
def test_with_the_same_secret_both_proofs_check_out() -> None:
    at_dialler, at_listener = exchange(side(WORKER, SECRET), side(PS, SECRET))
    assert at_dialler.proof is not None and at_listener.proof is not None
    assert at_dialler.proof != at_listener.proof


@in_loop
def test_a_proof_made_with_another_secret_is_refused() -> None:
    with pytest.raises(rvz.AuthError, match="proof does not match"):
        exchange(side(WORKER, b"x" * 16), side(PS, SECRET))


@pytest.mark.parametrize(("ours", "theirs", "match"), [
    (None, SECRET, "requires a secret and this node has none"),
    (SECRET, None, "has no secret and this node requires one"),
])
@in_loop
def test_a_secret_on_one_side_only_is_refused(ours: bytes | None, theirs: bytes | None,
                                              match: str) -> None:
    _, fields = hello_of(side(WORKER, theirs))
    with pytest.raises(rvz.AuthError, match=match):
        side(PS, ours).on_hello(fields, dialled=None, our_nonce=b"n" * 16)


@in_loop
def test_a_proof_is_bound_to_its_side_of_the_connection() -> None:
    """A relay without the secret dials both nodes, each as the other, and hands each the
    other's nonce: the proof one node gives is then the one the other expects, but for the
    side of the connection it was made on.  Passed over, it is refused."""
    worker, ps = side(WORKER, SECRET), side(PS, SECRET)
    w_nonce, w_fields = hello_of(worker)  # to the relay, which passes it to ps as its own
    p_nonce, p_fields = hello_of(ps)      # to the relay, which passes it to worker
    at_ps = ps.on_hello(w_fields, dialled=None, our_nonce=p_nonce)
    at_worker = worker.on_hello(p_fields, dialled=None, our_nonce=w_nonce)
    assert at_ps.proof is not None
    with pytest.raises(rvz.AuthError, match="proof does not match"):
        worker.on_auth(at_worker, {"mac": at_ps.proof}, dialled=False, our_nonce=w_nonce)


@pytest.mark.parametrize("mac", [None, b"", "text", b"\0" * 32])
@in_loop
def test_a_malformed_or_missing_proof_is_refused(mac: Any) -> None:
    worker, ps = side(WORKER, SECRET), side(PS, SECRET)
    w_nonce, w_fields = hello_of(worker)
    p_nonce, _ = hello_of(ps)
    hello = ps.on_hello(w_fields, dialled=None, our_nonce=p_nonce)
    with pytest.raises(rvz.AuthError):
        ps.on_auth(hello, {} if mac is None else {"mac": mac}, dialled=False, our_nonce=p_nonce)


@in_loop
def test_an_auth_nobody_asked_for_is_a_protocol_error() -> None:
    _, fields = hello_of(side(WORKER))
    plain = side(PS)
    hello = plain.on_hello(fields, dialled=None, our_nonce=b"")
    with pytest.raises(rvz.ProtocolError, match="unexpected AUTH"):
        plain.on_auth(hello, {"mac": b"m" * 32}, dialled=False, our_nonce=b"")
    with pytest.raises(rvz.ProtocolError, match="unexpected AUTH"):
        side(PS, SECRET).on_auth(None, {"mac": b"m" * 32}, dialled=False, our_nonce=b"")


@pytest.mark.parametrize("nonce", [b"short", b"n" * 17])
@in_loop
def test_a_malformed_nonce_is_refused_with_a_secret(nonce: bytes) -> None:
    _, fields = hello_of(side(WORKER, SECRET), n=nonce)
    with pytest.raises(rvz.ProtocolError, match="malformed nonce"):
        side(PS, SECRET).on_hello(fields, dialled=None, our_nonce=b"o" * 16)


@in_loop
def test_our_own_nonce_sent_back_is_refused() -> None:
    ps = side(PS, SECRET)
    p_nonce, _ = hello_of(ps)
    _, fields = hello_of(side(WORKER, SECRET), n=p_nonce)
    with pytest.raises(rvz.ProtocolError, match="malformed nonce"):
        ps.on_hello(fields, dialled=None, our_nonce=p_nonce)


@pytest.mark.parametrize(("change", "match"), [
    ({"v": 1}, "protocol version 1"),
    ({"order": "big" if sys.byteorder == "little" else "little"}, "endian"),
    ({"inc": -1}, "out-of-range"),
    ({"inc": 1 << 64}, "out-of-range"),
    ({"win": -1}, "out-of-range"),
    ({"park": 1 << 63}, "out-of-range"),
    ({"n": "not bytes"}, "out-of-range"),
    ({"task": "x"}, "malformed"),
    ({"inc": None}, "malformed"),
])
@in_loop
def test_a_hello_with_bad_fields_is_refused(change: dict[str, Any], match: str) -> None:
    _, fields = hello_of(side(WORKER), **change)
    with pytest.raises(rvz.ProtocolError, match=match):
        side(PS).on_hello(fields, dialled=None, our_nonce=b"")


@pytest.mark.parametrize("missing", ["v", "job", "task", "inc"])
@in_loop
def test_a_hello_missing_a_field_is_refused(missing: str) -> None:
    _, fields = hello_of(side(WORKER))
    del fields[missing]
    with pytest.raises(rvz.ProtocolError, match="missing fields"):
        side(PS).on_hello(fields, dialled=None, our_nonce=b"")


@in_loop
def test_a_peer_that_claims_to_be_us_is_refused() -> None:
    _, fields = hello_of(side(PS))
    with pytest.raises(rvz.ProtocolError, match="claims to be this node"):
        side(PS).on_hello(fields, dialled=None, our_nonce=b"")


@in_loop
def test_the_task_we_dialled_must_answer() -> None:
    _, fields = hello_of(side(("worker", 1)))
    with pytest.raises(rvz.ProtocolError, match="dialled /job:ps/replica:0/task:0 at h:1"):
        side(WORKER).on_hello(fields, dialled=PS, our_nonce=b"", address="h:1")


@in_loop
def test_a_task_outside_the_cluster_is_refused() -> None:
    _, fields = hello_of(side(("worker", 5)))
    with pytest.raises(rvz.ProtocolError, match="not in our cluster"):
        side(PS).on_hello(fields, dialled=None, our_nonce=b"")


@in_loop
def test_a_replaced_incarnation_is_refused_while_the_newer_one_is_connected() -> None:
    ps = side(PS)
    ps.check_replaced(WORKER, 1, None, False)  # never replaced: nothing to say
    ps.replaced(WORKER, 1)                      # incarnation 2 took its place
    with pytest.raises(rvz.AuthError, match="two processes run as"):
        ps.check_replaced(WORKER, 1, 2, True)
    assert ps.replaced_of(WORKER) == (1,)
    ps.check_replaced(WORKER, 3, 2, True)       # a newcomer is never refused
    ps.check_replaced(WORKER, 1, 2, False)      # the newer one is gone: taken back
    assert ps.replaced_of(WORKER) == ()


@in_loop
def test_only_the_last_replaced_incarnations_are_kept() -> None:
    ps = side(PS)
    for old in range(REPLACED_KEPT + 5):
        ps.replaced(WORKER, old)
    assert ps.replaced_of(WORKER) == tuple(range(5, REPLACED_KEPT + 5))
    ps.check_replaced(WORKER, 0, 99, True)  # forgotten: taken as a newcomer
