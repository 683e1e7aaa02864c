"""Does the current token's routing at OTHER keys predict a key's use soon? (default-policy research, round three)

Round three's ceiling fitted only each key's own history. Cross-key information is the
one online, lossless signal it left out: experts that tend to be used in the tokens
after a given expert fires (co-activation, across layers too). This asks whether that
adds predictive power before anyone builds a policy on it.

At every 8th token t of a trace, for a random quarter of the keys j NOT used at t (the
eviction candidates),
label: j is used within the next h tokens (h = 4, 16: the popularity horizon that the
round-three oracle shows matters). Features:

  own  log2 decayed use counts of j (half-lives 1, 4, 16, 64, 256 tokens), tokens since
       its last use (capped 512), its layer;
  co   mean over the keys i used at t of P(j used within h tokens after i is used),
       the matrix estimated on the OTHER trace (code for general and vice versa), so the
       feature never sees the test trace's future;
  co0  the same with i restricted to j's own layer.

A gradient-boosted classifier (scikit-learn HistGradientBoosting; research only:
`.venv/bin/pip install scikit-learn`) is trained on one trace and scored on the other
(AUC, log loss), with own features only and with the co features added.

    .venv/bin/python research/coactivation_signal.py [--tokens 8000] [--every 8] [--same]

``--same``: the matrix from the first half of the same trace, rows from its second half
(what an online learner would have), instead of from the other trace.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import TRACES  # noqa: E402

from expertcache.trace import load_trace  # noqa: E402

HALF_LIVES = (1, 4, 16, 64, 256)


def used(name: str, tokens: int) -> tuple[np.ndarray, int, int]:
    """Indicator ``[T, L*E]`` of the keys each token used, and L, E."""
    tr = load_trace(TRACES / f"qwen3-30b-a3b-{name}.npz").slice_tokens(tokens)
    L, T, _ = tr.experts.shape
    E = tr.num_experts
    X = np.zeros((T, L * E), np.float32)
    keys = tr.experts.astype(np.int64) + (np.arange(L) * E)[:, None, None]   # [L, T, k]
    for layer in range(L):
        X[np.arange(T)[:, None], keys[layer]] = 1.0
    return X, L, E


def future(X: np.ndarray, h: int) -> np.ndarray:
    """``[T, N]``: key used in tokens t+1..t+h (0 past the end)."""
    c = np.cumsum(np.vstack([np.zeros((1, X.shape[1]), np.float32), X]), axis=0)   # [T+1, N]
    T = X.shape[0]
    hi = np.minimum(np.arange(T) + h + 1, T)
    return (c[hi] - c[np.arange(T) + 1] > 0).astype(np.float32)


def coactivation(X: np.ndarray, F: np.ndarray, L: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    """P(j in the next h tokens | i used now), ``[N, N]``, and its same-layer part."""
    n_i = X.sum(0)[:, None] + 1.0
    C = (X.T @ F) / n_i                                                            # [N, N]
    same = np.kron(np.eye(L, dtype=np.float32), np.ones((E, E), np.float32))
    return C, C * same


def rows(X, L, E, h, C, C0, every, keep=0.25, seed=0, start=64):
    """Features and labels of a quarter of the unused keys at every ``every``-th token from ``start``."""
    T, N = X.shape
    F = future(X, h)
    decay = [np.float32(0.5 ** (1 / hl)) for hl in HALF_LIVES]
    counts = np.zeros((len(HALF_LIVES), N), np.float32)
    last = np.full(N, -10_000, np.int64)
    feats, labels = [], []
    layer = np.repeat(np.arange(L), E).astype(np.float32)
    rng = np.random.default_rng(seed)
    for t in range(T - h):
        counts = counts * np.array(decay)[:, None] + X[t]
        last[X[t] > 0] = t
        if t % every or t < start:
            continue
        cand = (X[t] == 0) & (rng.random(N) < keep)  # unused keys, subsampled
        now = X[t] > 0
        co = X[t] @ C / now.sum()                       # [N] mean over the keys used now
        co0 = X[t] @ C0 / (now.sum() / L)               # own layer's keys only (k of them)
        age = np.minimum(t - last, 512).astype(np.float32)
        f = np.vstack([np.log2(counts + 1e-3), age[None], layer[None], co[None], co0[None]])[:, cand]
        feats.append(f.T)
        labels.append(F[t, cand])
    return np.vstack(feats), np.concatenate(labels)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--horizons", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--same", action="store_true",
                    help="co matrix from the first half of the SAME trace, rows from its second half")
    args = ap.parse_args(argv)
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.metrics import log_loss, roc_auc_score

    data = {name: used(name, args.tokens) for name in ("code", "general")}
    own = list(range(len(HALF_LIVES) + 2))                     # counts, age, layer
    n_own = len(own)
    for h in args.horizons:
        co = {}
        for name, (X, L, E) in data.items():
            first = X[: args.tokens // 2] if args.same else X
            co[name] = coactivation(first, future(first, h), L, E)
        for train, test in (("code", "general"), ("general", "code")):
            t0 = time.time()
            # the co matrices come from the trace NOT being featurised, so neither side
            # sees its own future through them
            if args.same:  # causal: each trace's own first half
                Xtr, ytr = rows(*data[train], h, *co[train], args.every, start=args.tokens // 2)
                Xte, yte = rows(*data[test], h, *co[test], args.every, start=args.tokens // 2)
            else:
                Xtr, ytr = rows(*data[train], h, *co[test], args.every)
                Xte, yte = rows(*data[test], h, *co[train], args.every)
            for label, cols in (("own", own), ("own+co", own + [n_own, n_own + 1]),
                                ("own+co(same layer)", own + [n_own + 1])):
                clf = HistGradientBoostingClassifier(max_iter=150, learning_rate=0.1, random_state=0)
                clf.fit(Xtr[:, cols], ytr)
                p = clf.predict_proba(Xte[:, cols])[:, 1]
                print(f"h={h:2d} train {train:7s} test {test:7s} {label:20s} "
                      f"AUC {roc_auc_score(yte, p):.4f}  log loss {log_loss(yte, p):.4f}  "
                      f"(rows {len(ytr)}/{len(yte)}, base rate {yte.mean():.3f}, {time.time() - t0:.0f}s)",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
