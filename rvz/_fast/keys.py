"""Rendezvous keys: the TF key string, its parser, and device-name routing.

A key names one edge of a split graph:
``src_device;src_incarnation;dst_device;edge_name;frame_id:iter_id`` with the incarnation
as 16 zero-padded hex digits.  ``str(key)`` is the canonical form; the table and the wire
use it, so two spellings of one key (say an unpadded incarnation) always meet.
"""

from __future__ import annotations

import operator
from typing import Any

from ..errors import KeyFormatError

try:  # Cython's own module; a compiled build sees the constant True
    import cython
    COMPILED = cython.compiled
except ImportError:  # pure Python without Cython installed
    COMPILED = False

_MAX_U64 = (1 << 64) - 1
_MAX_U64_TEXT = str(_MAX_U64)
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


def _check_part(what: str, value: object) -> str:
    """A device or edge name as the key stores it: a non-empty ``str`` without ';'."""
    if type(value) is not str:
        if not isinstance(value, str):
            raise KeyFormatError(f"key {what} {value!r} is not a string")
        # A subclass (a StrEnum, say) is stored as the plain string: its own __str__ or
        # __format__ must not change the key's string form.
        value = str.__str__(value)
    if not value or ";" in value:
        raise KeyFormatError(f"key {what} {value!r} is empty or contains ';'")
    return value


def as_index(value: Any) -> Any:
    """``value`` as an exact ``int`` if it is an integer (numpy's and int subclasses too)
    other than a bool, else None: what every id rvz carries as a number takes (a task, a
    step, a key's frame, iter and incarnation).

    ``operator.index`` takes bool (True would be 1), and numpy's bool in some numpy
    versions (with a DeprecationWarning): those are refused by their type's name ("bool",
    numpy's "bool_" or "bool"), with no import of numpy here.
    """
    if type(value) is int:
        return value
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
        return None
    try:
        return operator.index(value)  # always an exact int
    except TypeError:
        return None


def _check_number(what: str, value: Any) -> int:
    """A frame, iter or incarnation as the key stores it: an int in 0..2**64-1.

    The string form and ``Key.parse`` carry exactly those (the incarnation as 16 hex
    digits; frame and iter bounded alike, as TensorFlow's 64-bit ids are).  Other integer
    types (numpy's, int subclasses) are stored as ``int``; bool, float and str are refused
    ("True:False" is no frame:iter).
    """
    if type(value) is not int:
        number = as_index(value)
        if number is None:
            raise KeyFormatError(f"key {what} {value!r} is not an integer")
        value = number
    if not 0 <= value <= _MAX_U64:
        # str() of an int of thousands of digits raises ValueError: name its size instead.
        shown = value if value.bit_length() <= 256 else f"of {value.bit_length()} bits"
        raise KeyFormatError(f"key {what} {shown} is not in 0..2**64-1")
    return value


def _parse_number(text: str) -> int | None:
    """ASCII digits (leading zeros allowed) to an int, or None if not in 0..2**64-1."""
    if not _is_digits(text) or len(text.lstrip("0")) > len(_MAX_U64_TEXT):
        return None  # int() of thousands of digits would raise ValueError, or be slow
    value = int(text)
    return value if value <= _MAX_U64 else None


class Key:
    """An immutable rendezvous key; ``str(key)`` is its TF string form.

    ``src`` and ``dst`` are device names and ``name`` the edge name: strings, not empty, no
    ';'.  ``frame``, ``iter`` and ``incarnation`` are ints in 0..2**64-1 (not bool).  Any
    other value raises ``KeyFormatError`` naming the field.
    """

    __slots__ = ("src", "dst", "name", "frame", "iter", "incarnation", "_text", "_src_task", "_dst_task")

    def __init__(self, src: str, dst: str, name: str, frame: int = 0, iter: int = 0,
                 incarnation: int = 0) -> None:
        # Every field is checked here, once: what str() writes, parse() must read back.
        src = _check_part("src", src)
        dst = _check_part("dst", dst)
        name = _check_part("name", name)
        frame = _check_number("frame", frame)
        iter = _check_number("iter", iter)
        incarnation = _check_number("incarnation", incarnation)
        # Checked here, so a malformed device fails when the key is built, not at send.
        src_task = route_of(src)
        dst_task = route_of(dst)
        if COMPILED:  # C stores into the struct; __setattr__ is for Python code only
            self.src = src
            self.dst = dst
            self.name = name
            self.frame = frame
            self.iter = iter
            self.incarnation = incarnation
            self._text: Any = None
            self._src_task: Any = src_task
            self._dst_task: Any = dst_task
        else:  # pure Python: through the slots' own setters, past our __setattr__
            _SET_SRC(self, src)
            _SET_DST(self, dst)
            _SET_NAME(self, name)
            _SET_FRAME(self, frame)
            _SET_ITER(self, iter)
            _SET_INCARNATION(self, incarnation)
            _SET_TEXT(self, None)
            _SET_SRC_TASK(self, src_task)
            _SET_DST_TASK(self, dst_task)

    @classmethod
    def parse(cls, text: str) -> Key:
        """The exact inverse of ``str(key)``; raises ``KeyFormatError`` naming the string
        (``TypeError`` if ``text`` is not a ``str``)."""
        if not isinstance(text, str):
            raise TypeError(f"Key.parse takes a key string, not {type(text).__name__}")
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
        frame = _parse_number(frame_s) if sep else None
        iter = _parse_number(iter_s) if sep else None
        if frame is None or iter is None:
            raise KeyFormatError(f"key {text!r}: {frame_iter!r} is not frame_id:iter_id "
                                 "(numbers in 0..2**64-1)")
        if not src or not dst:
            raise KeyFormatError(f"key {text!r} has an empty device name")
        key = cls(src, dst, name, frame, iter, incarnation)
        return key

    def __str__(self) -> str:
        text = self._text
        if text is None:
            text = (f"{self.src};{self.incarnation:016x};{self.dst};{self.name};"
                    f"{self.frame}:{self.iter}")
            if COMPILED:
                self._text = text
            else:
                _SET_TEXT(self, text)
        return text

    # The compiled class refuses writes too (readonly fields); one message for both.
    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"rvz.Key is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"rvz.Key is immutable: cannot delete {name!r}")

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


if not COMPILED:
    # Each slot's own setter, for Key's pure-Python __init__ and __str__ to write past its
    # __setattr__ (object.__setattr__ would look the name up on every write: slower).
    _SET_SRC, _SET_DST, _SET_NAME = (vars(Key)[f].__set__ for f in ("src", "dst", "name"))
    _SET_FRAME, _SET_ITER, _SET_INCARNATION = (vars(Key)[f].__set__
                                               for f in ("frame", "iter", "incarnation"))
    _SET_TEXT, _SET_SRC_TASK, _SET_DST_TASK = (vars(Key)[f].__set__
                                               for f in ("_text", "_src_task", "_dst_task"))


def _lower_hex(text: str, start: int, end: int) -> bool:
    """``text[start:end]`` holds only 0-9 and a-f, the digits of a canonical incarnation."""
    for i in range(start, end):
        c = text[i]
        if not ("0" <= c <= "9" or "a" <= c <= "f"):
            return False
    return True


def _canonical_number(text: str, start: int, end: int) -> bool:
    """``text[start:end]`` is a number as ``str(int)`` writes it: ASCII digits, no leading
    zero, and at most 2**64-1 (what ``Key.parse`` takes)."""
    if not _digits(text, start, end) or (text[start] == "0" and end - start > 1):
        return False
    n = len(_MAX_U64_TEXT)
    # Same length: the string order is the numeric one (a slice only in this rare case).
    return end - start < n or (end - start == n and text[start:end] <= _MAX_U64_TEXT)


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
