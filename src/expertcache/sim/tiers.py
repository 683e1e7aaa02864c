"""Two tiers replayed: device slots in front of a RAM tier in front of the model file.

``replay_tiers`` steps a trace through the device's ``SlotTable`` (optional: the CPU engine has
none) and, for every step, hands the RAM tier's ``SlotTable`` what the live run hands it
(``runtime/tiered.py`` via ``runtime/experts.py``):

- no device tier: the step's experts, in rank order (the CPU engine computes from RAM);
- device slots: the experts the slot plan loads, then those it bypasses (a slot miss is
  served from RAM, else read from the file); a step with no slot miss does not reach RAM.

Each RAM miss is one expert read from the file. Counts: device hits, RAM hits, file reads,
and file bytes per token (``expert_bytes`` per read).

The bound scored against: the RAM tier under Belady (forced admission) on the very stream of
requests the device tier leaves. Without a device tier that is the optimum of file reads for
the pair (all requests reach RAM; forced admission) wherever every step fits the tier (a step
wider than the tier, a long prompt's, bypasses part of itself, and there the online order of
bypasses can do better; ``tests/test_tiers.py`` checks the bound on decode steps). With device slots no joint optimum
of the pair is computed: the bound is the RAM tier's optimum *given* the device policy, and
``bound`` says so. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache import SlotTable
from ..policies.belady import Future
from ..stats import DECODE, PREFILL, Stats
from ..trace.format import Trace
from .replay import Prepared


@dataclass
class TierResult:
    """One replay of both tiers. ``gpu`` is None without device slots."""

    ram: Stats
    gpu: Stats | None
    ram_slots: int
    ram_policy: str
    gpu_slots: int
    gpu_policy: str | None
    tokens: list[int] = field(default_factory=lambda: [0, 0])  # [phase]
    expert_bytes: float | None = None

    def phase(self, phase: int) -> dict:
        """Counters of one phase: device hits, RAM hits, file reads, file bytes per token."""
        ram = self.ram.sums(phase)
        out = {"tokens": self.tokens[phase], "ram_accesses": ram["accesses"], "ram_hits": ram["hits"],
               "file_reads": ram["loads"] + ram["bypasses"]}
        if self.gpu is not None:
            gpu = self.gpu.sums(phase)
            out.update(gpu_accesses=gpu["accesses"], gpu_hits=gpu["hits"])
        out["ram_hit_rate"] = out["ram_hits"] / out["ram_accesses"] if out["ram_accesses"] else 0.0
        if self.expert_bytes:
            tok = self.tokens[phase]
            out["file_bytes_per_token"] = out["file_reads"] * self.expert_bytes / tok if tok else 0.0
        return out

    def to_dict(self) -> dict:
        return {"ram_slots": self.ram_slots, "ram_policy": self.ram_policy, "gpu_slots": self.gpu_slots,
                "gpu_policy": self.gpu_policy, "expert_bytes": self.expert_bytes,
                "prefill": self.phase(PREFILL), "decode": self.phase(DECODE)}


def replay_tiers(trace: Trace | Prepared, ram_slots: int, ram_policy="lru", gpu_slots: int = 0,
                 gpu_policy="default", partition: str = "global", gpu_admission=None,
                 expert_bytes: float | None = None) -> TierResult:
    """Replay ``trace`` through device slots (``gpu_slots``, 0: none) and the RAM tier.
    ``gpu_admission`` None: the device policy's own admission, as the live table takes it."""
    prep = trace if isinstance(trace, Prepared) else Prepared(trace)
    L, E, k = prep.L, prep.E, prep.trace.top_k
    if expert_bytes is None:
        expert_bytes = prep.trace.meta.get("expert_bytes")

    def device_table() -> SlotTable | None:
        if not gpu_slots:
            return None
        table = SlotTable(L, E, gpu_slots, eviction=gpu_policy, admission=gpu_admission, partition=partition,
                          top_k=k)
        if table.needs_future:
            table.bind_future(prep.future())
        return table

    gpu = device_table()
    ram = SlotTable(L, E, ram_slots, eviction=ram_policy, admission="always", partition="global", top_k=k)
    tokens = [0, 0]
    widths = _token_counts(prep)
    if ram.needs_future:  # an oracle RAM tier: its future is the stream the device tier leaves
        ram.bind_future(Future(r for _, _, r in _requests(prep, device_table()) if r))
    for (layer, phase, requests), width in zip(_requests(prep, gpu), _layer_widths(prep, widths)):
        if layer == 0:
            tokens[phase] += width
        if requests:
            ram.step(layer, [key - layer * E for key in requests], phase)
    return TierResult(ram.stats(), None if gpu is None else gpu.stats(), ram_slots, ram.eviction_name,
                      gpu_slots, None if gpu is None else gpu.eviction_name, tokens, expert_bytes)


def bound(trace: Trace | Prepared, ram_slots: int, gpu_slots: int = 0, gpu_policy="default",
          partition: str = "global", gpu_admission=None, expert_bytes: float | None = None
          ) -> tuple[TierResult, str]:
    """``(result, what it is)``: the RAM tier under Belady on the stream the device tier leaves."""
    result = replay_tiers(trace, ram_slots, "belady", gpu_slots, gpu_policy, partition, gpu_admission,
                          expert_bytes)
    what = ("optimum of file reads (Belady on the RAM tier; every step reaches it), forced admission"
            if not gpu_slots else
            f"the RAM tier's optimum given the device tier's {result.gpu_policy} (Belady on the stream of "
            "slot misses); no joint optimum of the pair is computed")
    return result, what


def _requests(prep: Prepared, gpu: SlotTable | None):
    """``(layer, phase, keys the RAM tier is asked for)`` per step, in the live order."""
    for tok, phase in zip(prep.step_lists, prep.row_phases):
        for layer, experts in enumerate(tok):
            base = layer * prep.E
            if gpu is None:
                yield layer, phase, [base + e for e in experts]
                continue
            plan = gpu.step(layer, experts, phase)
            yield layer, phase, [*plan.loads, *plan.bypasses]


def _token_counts(prep: Prepared) -> list[int]:
    """Tokens of each row of ``step_lists`` (a batched prompt row holds several)."""
    if prep.order == "grouped":
        from ..trace.steps import step_tokens
        return step_tokens(prep.trace)
    return [prep.prompt or 1] + [1] * (len(prep.step_lists) - 1) if prep.prompt else [1] * len(prep.step_lists)


def _layer_widths(prep: Prepared, widths: list[int]):
    for width in widths:
        for _ in range(prep.L):
            yield width
