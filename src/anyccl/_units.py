"""Sizes as people type them: "64M", "1GiB", "8" (powers of two, as nccl-tests)."""

from __future__ import annotations

from .errors import InvalidArgumentError

_SUFFIXES = {"B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
             "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def size_of(text: str, unit: int = 1) -> int | None:
    """'64K' -> 65536, '1M' / '1MiB' -> 1048576; a bare number counts `unit`s. None when
    `text` is not a size (or is negative)."""
    s = text.strip().upper()
    digits = s.rstrip("KMGIB")
    suffix = s[len(digits):]
    try:
        number = float(digits)
    except ValueError:
        return None
    if number < 0 or (suffix and suffix not in _SUFFIXES):
        return None
    return int(number * (_SUFFIXES[suffix] if suffix else unit))


def size_text(n: int) -> str:
    """`n` bytes as people read them: "128 KiB", "2 MiB", "1 GiB", "12 B"."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} B"


def parse_size(text: str | int, what: str = "size") -> int:
    """A size in bytes from `text` (or an int as it is); InvalidArgumentError naming `what`."""
    if isinstance(text, int):
        return text
    value = size_of(text)
    if value is None:
        raise InvalidArgumentError(f"{what}={text!r} is not a size; expected e.g. 8, 64K, 16M, 1G")
    return value
