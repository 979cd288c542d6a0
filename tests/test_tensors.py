"""Tensors of other frameworks as values: anything on the CPU that exports DLPack,
``__array_interface__`` or the buffer protocol is sent where it lies and received as a numpy
array; a tensor that cannot be sent (on a device, requiring grad, of a dtype numpy lacks)
fails its send with ``TypeError`` before anything leaves.

The framework-free tests use small exporters over numpy arrays; the torch tests run where
torch is installed (the ``torch`` extra) and skip with the reason printed elsewhere.
"""

from __future__ import annotations

import array
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import _impl

from .conftest import key, pair

MODES = ["recv", "send"]

try:
    import torch
except ImportError:  # the torch extra is not installed
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install 'rvz[torch]')")


class Exporter:
    """DLPack over a numpy array, as a framework's CPU tensor offers it."""

    def __init__(self, array: np.ndarray, device: tuple[int, int] = (1, 0)) -> None:
        self.array = array
        self.device = device

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


class Interface:
    """Memory described by ``__array_interface__`` only."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self.array.__array_interface__


def test_exported_memory_is_read_where_it_lies() -> None:
    source = np.arange(12, dtype=np.float32).reshape(3, 4)
    for value in (Exporter(source), Interface(source)):
        described, code, shape, nbytes = _impl.arrays.describe(value)
        assert np.shares_memory(described, source), type(value)
        assert (shape, nbytes) == ((3, 4), 48)
    buffer = array.array("i", [1, 2, 3])
    described, _, shape, nbytes = _impl.arrays.describe(buffer)
    assert described.dtype == np.int32 and shape == (3,) and nbytes == 12
    assert np.shares_memory(described, np.frombuffer(buffer, np.int32))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_exported_values_arrive_as_numpy_arrays(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    source = np.arange(6, dtype=np.int16).reshape(2, 3)
    async with pair(cluster, mode) as (w, p):
        await w.send(key("a"), Exporter(source))
        await w.send(key("b"), Interface(source[:, 1]))  # a strided view goes contiguous
        await w.send_many([(key("c"), array.array("d", [0.5, 1.5])), (key("d"), Exporter(source))])
        a, b, c, d = await p.recv_many([key("a"), key("b"), key("c"), key("d")], timeout=5)
        assert type(a) is np.ndarray and a.dtype == np.int16 and a.tolist() == source.tolist()
        assert b.tolist() == [1, 4]
        assert c.dtype == np.float64 and c.tolist() == [0.5, 1.5]
        assert d.tolist() == source.tolist()


class Grad(Exporter):
    requires_grad = True


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_a_tensor_that_cannot_be_sent_fails_before_anything_leaves(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    ok = np.arange(3, dtype=np.int64)
    refused = [
        (Exporter(ok, device=(2, 0)), "on a CUDA device (0): use a CPU copy"),
        (Grad(ok), "requires grad: send value.detach()"),
        (object(), "not builtins.object"),
    ]
    async with pair(cluster, mode) as (w, p):
        for value, says in refused:
            with pytest.raises(TypeError) as info:
                await w.send(key(), value)
            assert says in str(info.value), info.value
        await w.send(key(), ok + 1)
        assert (await p.recv(key(), timeout=5)).tolist() == [1, 2, 3]  # nothing else came
        # In a batch, every value is checked first: none of the items leaves.
        with pytest.raises(TypeError, match="requires grad"):
            await w.send_many([(key("x"), ok), (key("y"), Grad(ok)), (key("z"), ok)])
        await w.send_many([(key("x"), ok + 2), (key("z"), ok + 3)])
        assert (await p.recv(key("x"), timeout=5)).tolist() == [2, 3, 4]
        assert (await p.recv(key("z"), timeout=5)).tolist() == [3, 4, 5]


TORCH_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]


@needs_torch
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(20)
async def test_torch_tensors_of_every_dtype_round_trip(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    assert torch is not None
    async with pair(cluster, mode) as (w, p):
        sent = []
        for name in TORCH_DTYPES:
            tensor = (torch.arange(24) % 7).reshape(2, 3, 4).to(getattr(torch, name))
            sent.append(tensor)
            await w.send(key(name), tensor)
        await w.send(key("slice"), sent[10][:, 1])  # a non-contiguous view of a float32 tensor
        for name, tensor in zip(TORCH_DTYPES, sent, strict=True):
            got = await p.recv(key(name), timeout=5)
            back = torch.from_numpy(got)  # the documented way back to torch: no copy
            assert back.dtype == tensor.dtype and back.shape == tensor.shape
            assert torch.equal(back, tensor), name
        got = torch.from_numpy(await p.recv(key("slice"), timeout=5))
        assert torch.equal(got, sent[10][:, 1])


@needs_torch
def test_torch_tensors_that_cannot_be_sent_say_why() -> None:
    assert torch is not None
    with pytest.raises(TypeError, match="requires grad: send value.detach()"):
        _impl.arrays.describe(torch.zeros(2, requires_grad=True))
    with pytest.raises(TypeError, match=r"dtype torch.bfloat16: .*value.float\(\)"):
        _impl.arrays.describe(torch.zeros(2, dtype=torch.bfloat16))
    value, _, shape, nbytes = _impl.arrays.describe(torch.ones(2, 2).detach())
    assert shape == (2, 2) and nbytes == 16 and value.dtype == np.float32


def test_send_value_admits_tensors_by_type() -> None:
    def takes(value: rvz.types.SendValue) -> None:
        _impl.arrays.describe(value)

    takes(Exporter(np.zeros(2)))
    takes(Interface(np.zeros(2)))
