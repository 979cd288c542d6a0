"""The protocol engine driven without sockets: two engines joined in memory
(tests/enginepair.py), where each test decides when bytes cross.  Both implementations,
both loops."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import rvz

from .enginepair import PS, WORKER, Pair, codec, key

SECRET = b"k" * 16


async def test_a_push_arrives_and_its_credit_comes_back_by_quarter_windows() -> None:
    pair = await Pair.open("send", producer={"push_window": 4096}, consumer={"push_window": 4096})
    try:
        peer = pair.producer.core.peers[PS]
        full = peer.credit
        small = np.arange(10, dtype=np.int64)  # 80 bytes (and 64 of framing): under 1 KiB
        await pair.producer.send(key(), small)
        spent = full - peer.credit
        assert spent > small.nbytes, "a push spends its bytes and its framing"
        await pair.settle()
        assert (await pair.consumer.recv(key())).tolist() == list(range(10))
        await pair.settle()
        assert peer.credit == full - spent, "under a quarter window owed: not returned yet"
        await pair.producer.send(key(), np.zeros(1000, np.uint8))
        await pair.settle()
        assert (await pair.consumer.recv(key())).nbytes == 1000
        await pair.settle()
        assert peer.credit == full, "a quarter window owed: all of it returned in one CREDIT"
        assert peer.kept() == 0, "acknowledged with it: the producer keeps nothing"
    finally:
        pair.close()


async def test_a_push_past_the_window_waits_for_credit() -> None:
    pair = await Pair.open("send", producer={"push_window": 2048}, consumer={"push_window": 2048})
    try:
        value = np.zeros(1500, np.uint8)
        await pair.producer.send(key(), value)
        second = asyncio.ensure_future(pair.producer.send(key(), value))
        await pair.settle()
        assert not second.done(), "no credit: the second push waits"
        assert (await pair.consumer.recv(key())).nbytes == 1500
        await pair.settle()  # the credit crosses, the second push goes, and arrives
        await asyncio.wait_for(second, 5)
        assert (await pair.consumer.recv(key())).nbytes == 1500
    finally:
        pair.close()


async def test_a_recv_asks_and_a_later_send_answers_it() -> None:
    pair = await Pair.open("recv")
    try:
        waiting = asyncio.ensure_future(pair.consumer.recv(key()))
        await pair.settle()
        assert len(pair.producer.wire.parked) == 1, "the request parks at the producer"
        await pair.producer.send(key(), b"abc")
        await pair.settle()
        assert await asyncio.wait_for(waiting, 5) == b"abc"
        assert not pair.consumer.core.requests.by_id and not pair.producer.wire.parked
    finally:
        pair.close()


async def test_an_answer_that_crosses_a_cancel_goes_to_the_next_recv() -> None:
    """Counted as an answer, not a push (which would need the consumer's credit), and
    queued for the next recv."""
    pair = await Pair.open("recv")
    try:
        waiting = asyncio.ensure_future(pair.consumer.recv(key()))
        await pair.settle()
        await pair.producer.send(key(), b"one" * 100)  # answered: the answer is written...
        waiting.cancel()                          # ...and the recv cancelled before it lands
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await pair.settle()
        assert pair.consumer.core.requests.by_id == {}, "nothing is asked any more"
        assert pair.consumer.core.peers[WORKER].answered >= 300, "taken as an answer"
        assert await pair.recv(key()) == b"one" * 100, "neither lost nor taken twice"
        assert pair.consumer.wire.failed is None
        await pair.producer.send(key(), b"two")
        assert await pair.recv(key()) == b"two"
    finally:
        pair.close()


async def test_requests_past_the_producers_parks_are_held_back_until_answers_come() -> None:
    pair = await Pair.open("recv", producer={"max_parked": 2})
    try:
        names = [f"k{i}" for i in range(5)]
        waiting = [asyncio.ensure_future(pair.consumer.recv(key(n))) for n in names]
        await pair.settle()
        assert len(pair.producer.wire.parked) == 2, "only as many as it parks are asked"
        assert len(pair.consumer.core.peers[WORKER].held_back) == 3
        for n in names:
            await pair.producer.send(key(n), n.encode())
            await pair.settle()
        assert [await asyncio.wait_for(w, 5) for w in waiting] == [n.encode() for n in names]
        assert not pair.consumer.core.peers[WORKER].held_back
    finally:
        pair.close()


async def test_the_handshake_with_a_secret_runs_through_the_engines() -> None:
    pair = await Pair.open("send", secret=SECRET)
    try:
        await pair.producer.send(key(), b"x")
        await pair.settle()
        assert await pair.consumer.recv(key()) == b"x"
    finally:
        pair.close()


async def test_a_wrong_secret_fails_the_connection_with_auth_error() -> None:
    loop = asyncio.get_running_loop()
    from .enginepair import Side
    pair = Pair(Side(WORKER, "recv", loop, secret=SECRET), Side(PS, "recv", loop, secret=b"z" * 16))
    pair.producer.hello(pair.producer.wire)
    pair.consumer.hello(pair.consumer.wire)
    await pair.settle()
    reasons = [s.wire.close_reason for s in (pair.producer, pair.consumer) if s.wire.closed]
    assert reasons and all(isinstance(e, rvz.AuthError) for e in reasons), reasons
    assert not (pair.producer.wire.ready and pair.consumer.wire.ready)


@pytest.mark.parametrize("breach", ["bytes that are no frame", "a frame after BYE"])
async def test_what_breaks_the_protocol_fails_the_connection(breach: str) -> None:
    pair = await Pair.open("recv")
    try:
        wire = pair.producer.wire
        if breach == "a frame after BYE":
            wire.say_bye()
            wire.transport.write(codec.encode_ping())  # what BYE forbids
        else:
            wire.transport.write(b"\xff" * 64)
        pair.deliver(pair.producer)
        assert isinstance(pair.consumer.wire.failed, rvz.ProtocolError)
    finally:
        pair.close()


async def test_a_peer_cleaning_up_a_step_reaches_the_host() -> None:
    pair = await Pair.open("recv")
    try:
        pair.producer.wire.write_frame(codec.encode_abort_step(7, "done"))
        pair.deliver(pair.producer)
        assert ("on_abort_step", (7, "done")) in pair.consumer.calls
    finally:
        pair.close()
