"""The pool of small received arrays: an array is written over only once nothing refers to
it and it is still as made; arrays handed out are writable and independent; the pool stays
within its limits; and the decoder's staging buffer keeps partial frames intact when it
moves them."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import _impl

from .conftest import key, pair

ArrayPool = _impl.recvpool.ArrayPool
RecvPool = _impl.recvpool.RecvPool
codec = _impl.codec
recvpool = _impl.recvpool
U8 = 3  # the wire code of uint8
F4 = 11  # float32


def staged(values: list[int], nbytes: int) -> tuple[bytearray, list[int]]:
    """A staging buffer holding one ``nbytes`` payload per value (each byte that value)."""
    buf = bytearray()
    offsets = []
    for v in values:
        offsets.append(len(buf))
        buf += bytes([v]) * nbytes
    return buf, offsets


def take(pool: Any, value: int, nbytes: int = 64, code: int = U8,
         shape: tuple[int, ...] | None = None) -> Any:
    buf, (offset,) = staged([value], nbytes)
    if shape is None:
        shape = (nbytes // np.dtype(codec.DTYPES[code]).itemsize,)
    return pool.take(code, shape, buf, offset, nbytes)


def test_an_array_nothing_refers_to_is_written_over_with_the_next_value() -> None:
    pool = ArrayPool(1 << 20)
    first = take(pool, 1)
    ident = id(first)
    del first
    second = take(pool, 2)
    assert id(second) == ident and pool.reused == 1
    assert (second == 2).all() and second.flags.writeable and second.flags.owndata
    assert second.base is None


def test_an_array_in_use_is_never_written_over() -> None:
    pool = ArrayPool(1 << 20)
    held = [take(pool, i) for i in range(20)]  # each still referred to by the caller
    assert pool.reused == 0
    for i, arr in enumerate(held):
        assert (arr == i).all()
    for a, b in zip(held, held[1:], strict=False):
        assert a is not b and not np.shares_memory(a, b)


def test_a_consumer_holding_its_previous_array_cycles_through_two() -> None:
    pool = ArrayPool(1 << 20)
    prev = None
    for i in range(100):
        arr = take(pool, i % 251, nbytes=4096)
        assert (arr == i % 251).all()
        if prev is not None:
            assert arr is not prev and (prev == (i - 1) % 251).all()
        prev = arr
        del arr
    assert pool.reused >= 97
    assert sum(n for n, _ in pool.stats().values()) <= 3


def test_arrays_handed_out_are_independent_and_writable() -> None:
    pool = ArrayPool(1 << 20)
    a = take(pool, 1)
    b = take(pool, 2)
    a[:] = 7
    assert (b == 2).all()
    del a
    c = take(pool, 3)  # a's memory, written over: b is untouched
    assert (c == 3).all() and (b == 2).all()
    c[0] = 9
    assert b[0] == 2


@pytest.mark.parametrize("change", ["weakref", "readonly", "shape", "dtype", "strides"])
def test_an_array_changed_in_place_or_watched_is_not_handed_out_again(change: str) -> None:
    pool = ArrayPool(1 << 20)
    arr = take(pool, 1, nbytes=64, code=F4, shape=(2, 8))
    ident = id(arr)
    keep: Any = None
    if change == "weakref":
        keep = weakref.ref(arr)
    elif change == "readonly":
        arr.flags.writeable = False
    elif change == "shape":
        arr.shape = (8, 2)
    elif change == "dtype":
        arr.dtype = np.int32
    else:
        with warnings.catch_warnings():  # (deprecated in numpy 2.4, still possible)
            warnings.simplefilter("ignore", DeprecationWarning)
            arr.strides = (4, 8)  # a Fortran layout of the same bytes
    del arr
    new = take(pool, 2, nbytes=64, code=F4, shape=(2, 8))
    assert id(new) != ident and pool.reused == 0
    assert new.shape == (2, 8) and new.dtype == np.float32 and new.flags.writeable
    assert new.strides == (32, 4) and new.flags.c_contiguous
    assert (new.view(np.uint8) == 2).all()
    if change == "weakref":
        assert keep() is None  # let go of: what the weak reference saw was never reused


def test_kept_arrays_stay_within_the_limit_and_the_ring_bound() -> None:
    pool = ArrayPool(64 * 1024)
    held = [take(pool, i % 251, nbytes=4096) for i in range(100)]  # all alive at once
    assert pool.held <= pool.limit
    assert sum(n for n, _ in pool.stats().values()) <= pool.limit // 4096
    for i, arr in enumerate(held):
        assert (arr == i % 251).all()
    del held
    for i in range(100):  # dropped: the kept ones serve again, the limit holds
        take(pool, i, nbytes=4096)
        assert pool.held <= pool.limit
    assert pool.reused > 0


def test_a_ring_holds_at_most_its_bound() -> None:
    pool = ArrayPool(1 << 30)
    held = [take(pool, 0, nbytes=1) for _ in range(recvpool.RING_MAX + 10)]
    assert [n for n, _ in pool.stats().values()] == [recvpool.RING_MAX]
    assert len(held) == recvpool.RING_MAX + 10


def test_shapes_beyond_the_bound_get_new_arrays_and_unused_shapes_are_let_go() -> None:
    pool = ArrayPool(1 << 20)
    for n in range(1, recvpool.RINGS_MAX + 5):
        take(pool, 1, nbytes=n)
    assert len(pool.stats()) == recvpool.RINGS_MAX
    for _ in range(2 * recvpool.SWEEP):  # one shape in use: the others are let go
        take(pool, 1, nbytes=64)
    assert list(pool.stats()) == [(U8, (64,))]
    assert pool.held == 64 * pool.stats()[(U8, (64,))][0]


def test_a_receive_pool_keeps_small_arrays_within_a_share_of_its_limit() -> None:
    assert RecvPool(64 << 20).arrays.limit == (64 << 20) // recvpool.SMALL_SHARE
    assert RecvPool(1 << 30).arrays.limit == recvpool.SMALL_LIMIT


def feed(dec: Any, stream: bytes, read: int, each: Callable[[Any], None]) -> None:
    """Feed ``stream`` in reads of at most ``read`` bytes; ``each`` value as it comes."""
    pos = 0
    while pos < len(stream):
        buf = dec.get_buffer(-1)
        n = min(len(buf), read, len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        pos += n
        for event in dec.buffer_updated(n):
            if event[0] == codec.DATA_MANY:
                for value in event[3]:
                    each(value)
            elif event[0] == codec.DATA:
                each(event[4])


@pytest.mark.parametrize("read", [1000, 65536, 100_000])
def test_decoded_values_are_right_and_independent_across_reads_and_moves(read: int) -> None:
    # Reads that end inside frames, and a staging buffer filled to its end many times over:
    # the partial frame moved to its front arrives intact.
    dec = codec.Decoder(pool=RecvPool(64 << 20))
    stream = bytearray(codec.encode_hello({"v": 1}))
    expect = []
    for i in range(400):
        value = np.full(1000 + i % 7, i % 251, np.uint8)
        if i % 3 == 0:
            items = [(b"m", value), (b"n", np.full(16, i % 251, np.float32))]
            stream += codec.encode_data_many(0, items)
            expect += [v for _, v in items]
        else:
            stream += codec.encode_data(0, 0, b"k", U8, value.shape, value.nbytes)
            stream += value.tobytes()
            expect.append(value)
    got: list[Any] = []

    def each(value: Any) -> None:
        got.append(value)
        if len(got) > 4:
            got[-5] = None  # the consumer drops the older ones: their arrays serve again

    feed(dec, bytes(stream), read, each)
    assert len(got) == len(expect)
    alive = [(g, e) for g, e in zip(got, expect, strict=True) if g is not None]
    for g, e in alive:
        assert g.dtype == e.dtype and g.shape == e.shape and (g == e).all()
        assert g.flags.writeable
    for (a, _), (b, _) in zip(alive, alive[1:], strict=False):
        assert not np.shares_memory(a, b)
    assert dec.pool.arrays.reused > 0


async def test_a_recv_loop_keeping_its_previous_value_gets_intact_values(
        cluster: rvz.ClusterSpec) -> None:
    async with pair(cluster, "send") as (w, p):
        prev = None
        for i in range(200):
            await w.send(key(), np.full(4096, i % 251, np.uint8))
            value = await p.recv(key(), timeout=10)
            assert (value == i % 251).all() and value.flags.writeable
            if prev is not None:
                assert value is not prev and (prev == (i - 1) % 251).all()
            prev = value
        assert p._recv_pool is not None and p._recv_pool.arrays.reused > 0


async def test_without_a_receive_pool_small_values_are_new_arrays(
        cluster: rvz.ClusterSpec) -> None:
    async with pair(cluster, "send", ps={"recv_pool": 0}) as (w, p):
        for i in range(20):
            await w.send(key(), np.full(64, i, np.uint8))
            value = await p.recv(key(), timeout=10)
            assert (value == i).all() and value.flags.writeable and value.flags.owndata
        assert p._recv_pool is None
