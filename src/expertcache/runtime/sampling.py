"""Sampling settings shared by ``generate`` and ``serve``, checked once, turned into generate() kwargs."""

from __future__ import annotations

from dataclasses import dataclass

MAX_STOP = 4  # OpenAI's limit on stop sequences


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not _number(self.temperature) or not 0 <= self.temperature <= 2:
            raise ValueError(f"temperature must be between 0 and 2, got {self.temperature!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be above 0 and at most 1, got {self.top_p!r}")
        if not _whole(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a whole number >= 0, got {self.top_k!r}")
        if self.seed is not None and not _whole(self.seed):
            raise ValueError(f"seed must be a whole number, got {self.seed!r}")
        if len(self.stop) > MAX_STOP or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings, got {list(self.stop)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generate_kwargs(self) -> dict:
        """Everything model.generate needs; greedy passes no sampling knobs (they would warn)."""
        if self.greedy:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": float(self.temperature), "top_p": float(self.top_p),
                "top_k": int(self.top_k)}  # top_k 0: transformers adds no top-k filter

    def seed_now(self) -> None:
        """Seed torch's generator right before a sampled generate (the caller owns the model)."""
        if self.seed is not None and not self.greedy:
            import torch
            torch.manual_seed(self.seed)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
