"""Rendezvous keys: the TF string form, its exact inverse, malformed strings, routing."""

from __future__ import annotations

import enum
import random

import numpy as np
import pytest

import rvz
from rvz import _impl

from .conftest import PS, WORKER, key

SRC = "/job:worker/replica:0/task:3/device:CPU:0"
DST = "/job:ps/replica:1/task:7/device:GPU:2"


async def test_string_form_is_tf_form_with_16_hex_digit_incarnation() -> None:
    k = rvz.Key(src=SRC, dst=DST, name="emb_0", frame=2, iter=5, incarnation=0x1F)
    assert str(k) == f"{SRC};000000000000001f;{DST};emb_0;2:5"
    big = rvz.Key(src=SRC, dst=DST, name="x", incarnation=(1 << 64) - 1)
    assert str(big).split(";")[1] == "ffffffffffffffff"
    assert str(rvz.Key(SRC, DST, "x")).split(";")[1] == "0" * 16


async def test_issue_example() -> None:
    """A TensorFlow-style key formats to its canonical string."""
    k = rvz.Key(src="/job:worker/replica:0/task:0/device:CPU:0",
                dst="/job:ps/replica:0/task:0/device:CPU:0",
                name="emb_0", frame=0, iter=0, incarnation=1)
    assert str(k) == ("/job:worker/replica:0/task:0/device:CPU:0;0000000000000001;"
                      "/job:ps/replica:0/task:0/device:CPU:0;emb_0;0:0")


@pytest.mark.parametrize("fields", [
    dict(name="a", frame=0, iter=0, incarnation=0),
    dict(name="edge/with:colons", frame=3, iter=9, incarnation=0xDEADBEEF),
    dict(name="ü-name", frame=12345, iter=678, incarnation=(1 << 64) - 1),
])
async def test_parse_is_exact_inverse(fields: dict) -> None:
    k = rvz.Key(src=SRC, dst=DST, **fields)
    text = str(k)
    back = rvz.Key.parse(text)
    assert str(back) == text
    assert back == k and hash(back) == hash(k)
    assert (back.src, back.dst, back.name, back.frame, back.iter, back.incarnation) == (
        SRC, DST, fields["name"], fields["frame"], fields["iter"], fields["incarnation"])


async def test_unpadded_incarnation_names_the_same_key() -> None:
    k = rvz.Key.parse(f"{SRC};1f;{DST};x;0:0")
    assert k.incarnation == 0x1F
    assert k == rvz.Key(SRC, DST, "x", incarnation=0x1F)
    assert str(k) == f"{SRC};000000000000001f;{DST};x;0:0"


BAD = [
    pytest.param(f"{SRC};0000000000000001;{DST};x", id="4-parts"),
    pytest.param(f"{SRC};0000000000000001;{DST};x;0:0;extra", id="6-parts"),
    pytest.param("", id="empty"),
    pytest.param(f"{SRC};0000000000000001;{DST};;0:0", id="empty-edge-name"),
    pytest.param(f"{SRC};;{DST};x;0:0", id="empty-incarnation"),
    pytest.param(f"{SRC};00000000000000001;{DST};x;0:0", id="17-hex-digits"),
    pytest.param(f"{SRC};00000000000000zz;{DST};x;0:0", id="non-hex-incarnation"),
    pytest.param(f"{SRC};0x1;{DST};x;0:0", id="0x-incarnation"),
    pytest.param(f"{SRC};-1;{DST};x;0:0", id="negative-incarnation"),
    pytest.param(f"{SRC};+1;{DST};x;0:0", id="plus-incarnation"),
    pytest.param(f"{SRC}; 1;{DST};x;0:0", id="space-incarnation"),
    pytest.param(f"{SRC};1_0;{DST};x;0:0", id="underscore-incarnation"),
    pytest.param(f"{SRC};1;{DST};x;0", id="no-colon"),
    pytest.param(f"{SRC};1;{DST};x;0:", id="empty-iter"),
    pytest.param(f"{SRC};1;{DST};x;:0", id="empty-frame"),
    pytest.param(f"{SRC};1;{DST};x;0:0:0", id="three-fields"),
    pytest.param(f"{SRC};1;{DST};x;a:0", id="letter-frame"),
    pytest.param(f"{SRC};1;{DST};x;-1:0", id="negative-frame"),
    pytest.param(f"{SRC};1;{DST};x;\u00b2:0", id="unicode-digit-frame"),
    pytest.param(f"{SRC};1;{DST};x;0:\u0663", id="arabic-digit-iter"),
    pytest.param(f";1;{DST};x;0:0", id="empty-src"),
    pytest.param(f"{SRC};1;;x;0:0", id="empty-dst"),
    pytest.param(f"{SRC};1;{DST};x;{1 << 64}:0", id="frame-2**64"),
    pytest.param(f"{SRC};1;{DST};x;0:{1 << 64}", id="iter-2**64"),
    pytest.param(f"{SRC};1;{DST};x;{'9' * 5000}:0", id="frame-5000-digits"),
]


@pytest.mark.parametrize("text", BAD)
async def test_malformed_strings_raise_key_format_error_naming_the_string(text: str) -> None:
    with pytest.raises(rvz.KeyFormatError) as info:
        rvz.Key.parse(text)
    assert repr(text) in str(info.value) or text in str(info.value)
    assert isinstance(info.value, rvz.RvzError)


# Spellings a node may be handed: canonical ones, and near misses of each field.
SPELLINGS = [s.values[0] for s in BAD] + [
    f"{SRC};000000000000001f;{DST};x;0:0",
    f"{SRC};000000000000001F;{DST};x;0:0",      # upper-case hex: parses, not canonical
    f"{SRC};1f;{DST};x;0:0",                    # unpadded: parses, not canonical
    f"{SRC};ffffffffffffffff;{DST};x;10:0",
    f"{SRC};000000000000000g;{DST};x;0:0",
    f"{SRC};0000000000000001;{DST};x;00:0",     # leading zero: parses, not canonical
    f"{SRC};0000000000000001;{DST};x;0:07",
    f"{SRC};0000000000000001;{DST};x;0:\u00b2",
    f"{SRC};0000000000000001;{DST};edge/a:b;123:456",
    f"{SRC};0000000000000001;{DST};\u00fc;0:0",
    f"{SRC};0000000000000001;{DST};;0:0",
    f"{SRC};0000000000000001;{DST};x;18446744073709551615:18446744073709551615",
    f"{SRC};0000000000000001;{DST};x;18446744073709551616:0",
    f"{SRC};0000000000000001;{DST};x;0:99999999999999999999",
    f"{SRC};0000000000000001;{DST};x;{'0' * 30}1:0",  # leading zeros: parses, not canonical
]


@pytest.mark.parametrize("text", SPELLINGS)
async def test_a_string_is_routed_unparsed_exactly_when_it_is_canonical(text: str) -> None:
    """The node's shortcut (``canonical_devices``) must agree with ``str(Key.parse(s)) == s``:
    a non-canonical spelling routed unparsed would be a second name for one key."""
    try:
        canonical = str(rvz.Key.parse(text)) == text
    except rvz.KeyFormatError:
        canonical = False
    devices = _impl.keys.canonical_devices(text)
    assert (devices is not None) == canonical, text
    if canonical:
        parsed = rvz.Key.parse(text)
        assert devices == (parsed.src, parsed.dst)


async def test_constructor_rejects_bad_fields() -> None:
    for kwargs in [dict(name=""), dict(name="a;b"), dict(src=""), dict(dst="x;y"),
                   dict(incarnation=-1), dict(incarnation=1 << 64), dict(frame=-1), dict(iter=-2)]:
        fields = dict(src=SRC, dst=DST, name="x")
        fields.update(kwargs)
        with pytest.raises(rvz.KeyFormatError):
            rvz.Key(**fields)


class Colour(str, enum.Enum):  # (enum.StrEnum is Python 3.11+; its str() is the value)
    RED = "red"


class Level(enum.IntEnum):
    THREE = 3


# Each field a value the string form cannot carry or Key.parse cannot read back.
UNCARRIED = [
    ("frame", 1.5), ("frame", True), ("frame", "1"), ("frame", None), ("frame", 1 << 64),
    ("frame", np.bool_(True)), ("frame", np.float64(2.0)),
    ("iter", True), ("iter", False), ("iter", 0.0), ("iter", -1), ("iter", 1 << 64),
    ("incarnation", 1.5), ("incarnation", True), ("incarnation", "1f"), ("incarnation", 1 << 64),
    ("incarnation", -1),
    ("src", 5), ("src", None), ("src", b"/job:a/task:0"), ("dst", 5), ("name", 5), ("name", b"x"),
    ("name", None),
]


@pytest.mark.parametrize("field, value", UNCARRIED, ids=[f"{f}={v!r}" for f, v in UNCARRIED])
async def test_constructor_refuses_what_the_string_form_cannot_carry(field: str, value: object) -> None:
    fields: dict = dict(src=SRC, dst=DST, name="x")
    fields[field] = value
    with pytest.raises(rvz.ConfigError) as info:
        rvz.Key(**fields)
    assert isinstance(info.value, rvz.KeyFormatError)
    assert field in str(info.value) and (repr(value) in str(info.value) or str(value) in str(info.value))


async def test_a_huge_frame_is_refused_naming_its_size() -> None:
    # str() of an int of more than 4300 digits raises ValueError: the message must not.
    with pytest.raises(rvz.KeyFormatError, match="frame of 16610 bits"):
        rvz.Key(SRC, DST, "x", frame=10 ** 5000)


ROUND_TRIPS = [
    dict(name="x"),
    dict(name="edge:with:colons/and/slashes", frame=(1 << 64) - 1, iter=(1 << 64) - 1,
         incarnation=(1 << 64) - 1),
    dict(name="\u00fc \t\u2603", frame=1, iter=0, incarnation=1),
    dict(name=Colour.RED, frame=np.int64(7), iter=np.uint64((1 << 64) - 1), incarnation=np.uint8(255)),
    dict(name="x", frame=Level.THREE, iter=Level.THREE, incarnation=Level.THREE),
]


@pytest.mark.parametrize("fields", ROUND_TRIPS)
async def test_every_accepted_key_reads_back(fields: dict) -> None:
    k = rvz.Key(src=SRC, dst=DST, **fields)
    back = rvz.Key.parse(str(k))
    assert back == k and str(back) == str(k) and hash(back) == hash(k)
    # Stored as the plain str and int the string form holds, whatever type was given.
    for field in ("src", "dst", "name", "frame", "iter", "incarnation"):
        assert type(getattr(k, field)) is type(getattr(back, field)), field
        assert getattr(k, field) == getattr(back, field), field
    assert type(k.name) is str and type(k.frame) is int and type(k.incarnation) is int


async def test_random_keys_read_back() -> None:
    rng = random.Random(11)
    for _ in range(2000):
        bits = [rng.choice([1, 8, 32, 63, 64]) for _ in range(3)]
        frame, iter, incarnation = (rng.getrandbits(b) for b in bits)
        k = rvz.Key(SRC, DST, f"e{rng.random()}", frame=frame, iter=iter, incarnation=incarnation)
        back = rvz.Key.parse(str(k))
        assert back == k and (back.frame, back.iter, back.incarnation) == (frame, iter, incarnation)
        assert _impl.keys.canonical_devices(str(k)) == (SRC, DST)


@pytest.mark.parametrize("text", [5, None, b"x", ["a"]])
async def test_parse_takes_only_a_string(text: object) -> None:
    with pytest.raises(TypeError, match=type(text).__name__):
        rvz.Key.parse(text)  # type: ignore[arg-type]


@pytest.mark.parametrize("attr", ["src", "dst", "name", "frame", "iter", "incarnation", "src_task",
                                  "_text", "_src_task", "not_a_field"])
async def test_keys_are_immutable(attr: str) -> None:
    k = rvz.Key(SRC, DST, "x", frame=1, iter=2, incarnation=3)
    text, h = str(k), hash(k)
    with pytest.raises(AttributeError):
        setattr(k, attr, "y")
    with pytest.raises(AttributeError):
        delattr(k, attr)
    assert str(k) == text and hash(k) == h and k.name == "x" and k.frame == 1
    assert k == rvz.Key.parse(text)


async def test_device_routing() -> None:
    k = rvz.Key(src=SRC, dst=DST, name="x")
    assert k.src_task == ("worker", 3)
    assert k.dst_task == ("ps", 7)
    assert rvz.parse_device("/job:a/task:0") == ("a", 0)
    assert rvz.parse_device("/job:trainer/replica:2/task:11/device:GPU:1") == ("trainer", 11)


@pytest.mark.parametrize("device", ["job:a/task:0", "/job:a", "/task:1", "/job:a/task:x",
                                    "/job:a/task:", "/job:a/task:\u00b2", "/job/task:1"])
async def test_bad_device_names(device: str) -> None:
    with pytest.raises(rvz.KeyFormatError) as info:
        rvz.parse_device(device)
    assert repr(device) in str(info.value)


async def test_a_key_whose_device_names_no_task_fails_when_built() -> None:
    with pytest.raises(rvz.KeyFormatError):
        rvz.Key(src="/device:CPU:0", dst=DST, name="x")
    with pytest.raises(rvz.ConfigError):  # a KeyFormatError is a ConfigError
        rvz.Key(src="worker:0", dst=DST, name="x")


async def test_keys_are_usable_as_dict_keys_and_compare_by_string() -> None:
    a = key("x")
    b = rvz.Key.parse(str(key("x")))
    assert {a: 1}[b] == 1
    assert a != key("y")
    assert a != key("x", iter=1)
    assert (a == str(a)) is False  # a Key never equals a plain string


@pytest.mark.loop_timeout(10)
async def test_string_keys_accepted_by_node(cluster) -> None:  # type: ignore[no-untyped-def]
    text = str(key("by_string"))

    async with rvz.Node(cluster, "worker", 0, linger=0.5) as w, \
            rvz.Node(cluster, "ps", 0, linger=0.5) as p:
        await w.send(text, np.arange(3))
        got = await p.recv(text, timeout=5)
        assert got.tolist() == [0, 1, 2]
        # The string form and the Key meet on one table entry.
        await w.send(key("by_string"), np.arange(2))
        got = await p.recv(text, timeout=5)
        assert got.tolist() == [0, 1]
        with pytest.raises(rvz.KeyFormatError):
            await w.send("not;a;key", np.arange(1))
        with pytest.raises(TypeError):
            await w.send(42, np.arange(1))


async def test_worker_and_ps_constants_route() -> None:
    assert key().src_task == ("worker", 0) and key().dst_task == ("ps", 0)
    assert key(src=PS, dst=WORKER).src_task == ("ps", 0)
