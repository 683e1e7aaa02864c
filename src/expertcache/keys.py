"""Expert keys: plain ints inside, a named tuple at API edges."""

from __future__ import annotations

from typing import NamedTuple


class ExpertKey(NamedTuple):
    layer: int
    expert: int
