"""Self-checks every bench run reports: the bytes, the counts and the outputs add up.

* copy-every-pass copies ``L * k * expert_bytes`` per decode token; a cache copies
  ``misses * expert_bytes`` (fetch path: loads and bypasses alike); cpu and resident
  copy nothing during decode;
* each cache's decode hits and misses equal ``expertcache sim``'s replay of the same
  trace, policy, slots and partition;
* every strategy's output per token (the last layer's hidden vector) equals the
  reference's, so no strategy can be fast by being wrong. The reference is resident
  when it ran, else the first strategy that did.
"""

from __future__ import annotations

from ..sim.replay import Prepared, replay
from ..stats import DECODE


def run_checks(result) -> dict:
    """{"bytes": [...failures], "sim": [...failures], "outputs": {title: max abs diff}, "ok": bool}."""
    shape, trace = result.shape, result.trace
    per_token = shape.layers * shape.top_k * shape.expert_bytes
    runs = [r for r in result.runs if not r.skipped]
    bytes_bad, sim_bad = [], []
    stepped = Prepared(trace, "token")  # the bench steps one token at a time
    for run in runs:
        s, n = run.strategy, len(run.seconds)
        want = {"copy-every-pass": n * per_token, "cpu": 0, "resident": 0}.get(
            s.kind, run.decode.misses * shape.expert_bytes)
        if run.h2d_decode != want:
            bytes_bad.append(f"{s.title}: copied {run.h2d_decode} bytes, expected {want}")
        if s.kind in ("cache", "belady"):
            sim = replay(stepped, s.sim_policy, s.slots, result.partition).stats.total(DECODE)
            if (sim.hits, sim.misses) != (run.decode.hits, run.decode.misses):
                sim_bad.append(f"{s.title}: {run.decode.hits} hits / {run.decode.misses} misses, "
                               f"sim says {sim.hits} / {sim.misses}")
    ref = next((r for r in runs if r.strategy.kind == "resident"), runs[0] if runs else None)
    diffs = {}
    for run in runs:
        if ref is not None and run.outputs.shape == ref.outputs.shape and run.outputs.numel():
            diffs[run.strategy.title] = float((run.outputs - ref.outputs).abs().max())
    scale = float(ref.outputs.abs().max()) if ref is not None and ref.outputs.numel() else 1.0
    # relative to the largest output: host and pool kernels round differently (bf16: 0.03 of ~4
    # after 8 layers measured for cpu vs resident), while a wrong or stale expert moves the
    # hidden vector by a sizeable fraction of its norm
    tol = 5e-2 if shape.dtype == "bf16" else 1e-4
    out_bad = [t for t, d in diffs.items() if not d <= tol * max(scale, 1e-6)]
    return {"reference": ref.strategy.title if ref is not None else None, "bytes": bytes_bad,
            "sim": sim_bad, "outputs_max_abs_diff": diffs, "outputs_mismatch": out_bad,
            "ok": not (bytes_bad or sim_bad or out_bad)}


def summary(checks: dict) -> str:
    """One line for the terminal."""
    if checks["ok"]:
        return ("checks: H2D bytes add up, cache hits/misses equal `expertcache sim`, every output "
                f"matches {checks['reference']} (max abs diff "
                f"{max(checks['outputs_max_abs_diff'].values(), default=0.0):.2g})")
    problems = checks["bytes"] + checks["sim"] + [f"{t}: output differs" for t in checks["outputs_mismatch"]]
    return "CHECKS FAILED: " + "; ".join(problems)
