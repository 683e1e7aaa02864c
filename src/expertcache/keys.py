"""Expert keys: plain ints inside, a named tuple at API edges."""

from __future__ import annotations

from typing import NamedTuple


class ExpertKey(NamedTuple):
    layer: int
    expert: int


def to_key(layer: int, expert: int, num_experts: int) -> int:
    return layer * num_experts + expert


def from_key(key: int, num_experts: int) -> ExpertKey:
    return ExpertKey(*divmod(key, num_experts))
