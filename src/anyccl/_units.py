"""Sizes and durations as people type them: "64M", "1GiB", "30s"."""

from __future__ import annotations

from .errors import InvalidArgumentError

_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
             "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str | int, what: str = "size") -> int:
    """'8' -> 8, '64K' -> 65536, '1M' / '1MiB' -> 1048576 (powers of two, as nccl-tests)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    digits = s.rstrip("KMGIB")
    suffix = s[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1
    if suffix not in _SUFFIXES or value < 0:
        raise InvalidArgumentError(f"{what}={text!r} is not a size; expected e.g. 8, 64K, 16M, 1G")
    return int(value * _SUFFIXES[suffix])
