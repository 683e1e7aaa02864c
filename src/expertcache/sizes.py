"""Memory sizes: parse "8GiB" / "512MB" / 1024 into bytes, and format them back."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1,
          "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes from an int or a string like '8GiB', '1.5 GB', '512MiB', '4096'."""
    if isinstance(value, bool):
        raise TypeError(f"a memory size must be a number of bytes or a string like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"a memory size must be positive, got {value}")
        return value
    if not isinstance(value, str):
        raise TypeError(f"a memory size must be a number of bytes or a string like '8GiB', "
                        f"got {type(value).__name__}")
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read memory size {value!r}; write a number with an optional unit, "
                         "e.g. '8GiB', '512MiB', '1.5GB' or '4096' (bytes)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


def format_size(nbytes: float) -> str:
    """'1.50 GiB' style, for summaries."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
