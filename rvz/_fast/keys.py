"""Rendezvous keys: the TF key string, its parser, and device-name routing.

A key names one edge of a split graph:
``src_device;src_incarnation;dst_device;edge_name;frame_id:iter_id`` with the incarnation
as 16 zero-padded hex digits.  ``str(key)`` is the canonical form; the table and the wire
use it, so two spellings of one key (say an unpadded incarnation) always meet.
"""

from __future__ import annotations

from typing import Any

from ..errors import KeyFormatError

_MAX_U64 = (1 << 64) - 1
_HEX_DIGITS = "0123456789abcdefABCDEF"


def _is_digits(text: str) -> bool:
    """Only ASCII digits: ``str.isdigit`` and ``int`` also take '²', signs, '_' and spaces."""
    return _digits(text, 0, len(text))


def _digits(text: str, start: int, end: int) -> bool:
    """``text[start:end]`` is one or more ASCII digits (compiled: C compares of code points)."""
    if end <= start:
        return False
    for i in range(start, end):
        c = text[i]
        if not "0" <= c <= "9":
            return False
    return True


def parse_device(device: str) -> tuple:
    """Split ``/job:J/replica:R/task:T/device:TYPE:N`` into ``(job, task)``.

    Only job and task route a key to a node; replica and device are kept in the string.
    """
    job = None
    task = None
    if not device.startswith("/"):
        raise KeyFormatError(f"device name {device!r} does not start with '/'")
    for part in device[1:].split("/"):
        name, sep, value = part.partition(":")
        if not sep or not value:
            raise KeyFormatError(f"device name {device!r}: component {part!r} is not name:value")
        if name == "job":
            job = value
        elif name == "task":
            if not _is_digits(value):
                raise KeyFormatError(f"device name {device!r}: task {value!r} is not a number")
            task = int(value)
    if job is None or task is None:
        raise KeyFormatError(f"device name {device!r} names no /job:…/task:… to route it")
    return (job, task)


_DEVICES: dict = {}  # device name -> (job, task): devices are few, keys many
_DEVICES_MAX = 4096


def route_of(device: str) -> tuple:
    """``parse_device`` with a cache: a key is checked when it is built, and building
    keys in a loop must not parse the same two device names every time."""
    task = _DEVICES.get(device)
    if task is None:
        task = parse_device(device)
        if len(_DEVICES) >= _DEVICES_MAX:
            _DEVICES.clear()
        _DEVICES[device] = task
    return task


def _check_part(what: str, value: str) -> None:
    if not value or ";" in value:
        raise KeyFormatError(f"key {what} {value!r} is empty or contains ';'")


class Key:
    """An immutable rendezvous key; ``str(key)`` is its TF string form."""

    __slots__ = ("src", "dst", "name", "frame", "iter", "incarnation", "_text", "_src_task", "_dst_task")

    def __init__(self, src: str, dst: str, name: str, frame: int = 0, iter: int = 0,
                 incarnation: int = 0) -> None:
        _check_part("src", src)
        _check_part("dst", dst)
        _check_part("name", name)
        if not 0 <= incarnation <= _MAX_U64:
            raise KeyFormatError(f"key incarnation {incarnation} is not an unsigned 64-bit number")
        if frame < 0 or iter < 0:
            raise KeyFormatError(f"key frame/iter {frame}:{iter} must not be negative")
        self.src = src
        self.dst = dst
        self.name = name
        self.frame = frame
        self.iter = iter
        self.incarnation = incarnation
        self._text: Any = None
        # Checked here, so a malformed device fails when the key is built, not at send.
        self._src_task: Any = route_of(src)
        self._dst_task: Any = route_of(dst)

    @classmethod
    def parse(cls, text: str) -> Key:
        """The exact inverse of ``str(key)``; raises ``KeyFormatError`` naming the string."""
        parts = text.split(";")
        if len(parts) != 5:
            raise KeyFormatError(f"key {text!r} has {len(parts)} ';'-separated parts, expected 5")
        src, inc, dst, name, frame_iter = parts
        if not name:
            raise KeyFormatError(f"key {text!r} has an empty edge name")
        # int(x, 16) alone would also take "0x1", "+1", "-1", " 1" and "1_0".
        if not inc or len(inc) > 16 or inc.strip(_HEX_DIGITS):
            raise KeyFormatError(f"key {text!r}: incarnation {inc!r} is not 1-16 hex digits")
        incarnation = int(inc, 16)
        frame_s, sep, iter_s = frame_iter.partition(":")
        if not sep or not _is_digits(frame_s) or not _is_digits(iter_s):
            raise KeyFormatError(f"key {text!r}: {frame_iter!r} is not frame_id:iter_id")
        if not src or not dst:
            raise KeyFormatError(f"key {text!r} has an empty device name")
        key = cls(src, dst, name, int(frame_s), int(iter_s), incarnation)
        return key

    def __str__(self) -> str:
        text = self._text
        if text is None:
            text = (f"{self.src};{self.incarnation:016x};{self.dst};{self.name};"
                    f"{self.frame}:{self.iter}")
            self._text = text
        return text

    def __repr__(self) -> str:
        return f"Key({str(self)!r})"

    def __hash__(self) -> int:
        return hash(str(self))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Key):
            return str(self) == str(other)
        return NotImplemented

    def __reduce__(self):
        return (Key, (self.src, self.dst, self.name, self.frame, self.iter, self.incarnation))

    @property
    def src_task(self) -> tuple:
        """``(job, task)`` of the producing node."""
        return self._src_task

    @property
    def dst_task(self) -> tuple:
        """``(job, task)`` of the consuming node."""
        return self._dst_task


def _lower_hex(text: str, start: int, end: int) -> bool:
    """``text[start:end]`` holds only 0-9 and a-f, the digits of a canonical incarnation."""
    for i in range(start, end):
        c = text[i]
        if not ("0" <= c <= "9" or "a" <= c <= "f"):
            return False
    return True


def _canonical_number(text: str, start: int, end: int) -> bool:
    """``text[start:end]`` is a number as ``str(int)`` writes it: ASCII digits, no leading
    zero."""
    return _digits(text, start, end) and (text[start] != "0" or end - start == 1)


def canonical_devices(text: str) -> Any:
    """``(src, dst)`` of a key string already in canonical form (what ``str(Key)`` gives),
    else None: the node routes such a string without building a ``Key``."""
    # The fields are found by position (compiled, C loops): only the two device names are
    # copied out of the string.  A new key costs this on the critical path of its first send.
    a = text.find(";")
    b = text.find(";", a + 1)
    c = text.find(";", b + 1)
    d = text.find(";", c + 1)
    # src, 16 digits of incarnation, dst and name, none empty, and no fifth ';'
    if a <= 0 or b - a != 17 or c <= b + 1 or d <= c + 1 or text.find(";", d + 1) >= 0:
        return None
    colon = text.find(":", d + 1)
    if (colon < 0 or not _lower_hex(text, a + 1, b) or not _canonical_number(text, d + 1, colon)
            or not _canonical_number(text, colon + 1, len(text))):
        return None
    return (text[:a], text[b + 1:c])


def as_key(key: object) -> Key:
    """Accept a ``Key`` or its string form."""
    if isinstance(key, Key):
        return key
    if isinstance(key, str):
        return Key.parse(key)
    raise TypeError(f"a rendezvous key is a rvz.Key or its string form, not {type(key).__name__}")
