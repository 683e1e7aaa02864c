"""How far can ANY history-based eviction ranking get? (default-policy research, round three)

A full-scan numba replay: on every eviction the victim is the resident, unprotected key
with the lowest score (ties: least recently used). The score is

  mode lru     0 for every key, so the LRU tie-break decides (validation: exactly LRU);
  mode oracle  the key's TRUE number of uses in the next W passes (not online: a perfect
               short-term popularity predictor), ties by LRU;
  mode learned an additive model (GAM) over binned, causal features of the key's access
               history, fitted OFFLINE on sampled (resident key, eviction time) rows.

Features (all causal, computed at the decision): age in passes (missed opportunities of
the key's layer), layer-phase wait (steps until its layer comes round; constant per
partition in a per-layer pool), log2 of use counts decayed with half-lives 1..512 passes,
uses / passes so far, mean and last inter-use gap, rank of its last selection, its layer's
recent lag-1 reuse rate (EMA, about 10 tokens), total uses, and 2-D tables count(hl 32) x age,
count(hl 4) x age, age x wait, mean gap x age. Labels: next use within h passes
(logistic, h = 1, 2, 4, 8) or log2(1 + passes to next use) (ridge). Rows: residents at
sampled evictions of a replay driven by LRU (round 0), then by the h=2 model fitted on
them (round 1, DAgger-like); the final models are fitted on both rounds, per config, on
the code trace, and replayed on code (in sample) and general (held out).

Needs scikit-learn in the venv for research only (`.venv/bin/pip install scikit-learn`;
not a project dependency).

    .venv/bin/python research/feature_ceiling.py validate
    .venv/bin/python research/feature_ceiling.py oracle code general
    .venv/bin/python research/feature_ceiling.py learn [--tokens N] [--ablate] [--save rows.npz]
    .venv/bin/python research/feature_ceiling.py gbdt rows.npz     # GAM vs GBDT, held-out rows
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import warnings

import numpy as np
from numba import njit

warnings.filterwarnings("ignore", module="sklearn")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from policy_research import load  # noqa: E402

from expertcache.sim.fast import NEVER  # noqa: E402
from expertcache.sim.replay import Prepared, replay  # noqa: E402

CONFIGS = (("global", 768), ("global", 1536), ("per-layer", 768), ("per-layer", 1536))
HL = np.array([1, 2, 4, 8, 16, 32, 64, 128, 512], np.float64)   # half-lives in passes
NH = len(HL)
NF = 21
MAXB = 256
NAMES = (["age", "wait"] + [f"c{int(h)}" for h in HL]
         + ["rate", "mgap", "lgap", "rank", "lreuse", "n", "c32xage", "c4xage", "agexwait",
            "mgapxage"])
GROUPS = {"age": [0], "phase": [1, 19], "counts": list(range(2, 11)) + [17, 18],
          "rate+n": [11, 16], "gaps": [12, 13, 20], "rank": [14], "layer-reuse": [15]}
NBINS = np.array([18, 48] + [35] * NH + [27, 27, 27, 8, 20, 27, 14 * 18, 14 * 18, 18 * 12,
                                        14 * 18], np.int64)
_AGE_EDGES = [0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512]
AGEBIN = (np.searchsorted(np.array(_AGE_EDGES), np.arange(8193), side="right") - 1).astype(np.int64)


@njit(cache=True)
def _clip(v, lo, hi):
    return lo if v < lo else (hi if v > hi else v)


@njit(cache=True)
def _bins(key, s, cur, L, E, last, lc, log2n, log2P, sb, ema, agebin, hl, b):
    """Feature bins of ``key`` at step ``s`` (current layer ``cur``) into ``b``."""
    dt = s - last[key]
    ai = dt // L
    af = dt / L
    ab = agebin[min(ai, agebin.size - 1)]
    b[0] = ab
    lay = key // E
    w = (lay - cur) % L
    if w == 0:
        w = L
    b[1] = w - 1
    for h in range(hl.size):
        x = lc[key, h] - af / hl[h]
        b[2 + h] = _clip(int(math.floor(2.0 * x)) + 14, 0, 34)
    c32 = _clip(int(math.floor(lc[key, 5] - af / 32.0)) + 7, 0, 13)
    c4 = _clip(int(math.floor(lc[key, 2] - af / 4.0)) + 7, 0, 13)
    b[11] = _clip(int(math.floor(2.0 * (log2n[key] - log2P))) + 26, 0, 26)
    b[12] = sb[key, 0]
    b[13] = sb[key, 1]
    b[14] = sb[key, 2]
    b[15] = _clip(int(ema[lay] * 20.0), 0, 19)
    b[16] = sb[key, 3]
    b[17] = c32 * 18 + ab
    b[18] = c4 * 18 + ab
    b[19] = ab * 12 + (w - 1) // 4
    b[20] = sb[key, 4] * 18 + ab


@njit(cache=True)
def _replay(keys, nexts, L, E, parts, cap, mode, tab, W, ustart, uend, usteps,
            sample_p, maxrows, seed, agebin, hl):
    """Misses of one replay; with ``sample_p`` > 0 also rows (bins, steps to next use)."""
    np.random.seed(seed)
    nkeys = L * E
    NFb = tab.shape[0]
    K = keys.shape[1]
    last = np.full(nkeys, -1, np.int64)
    lastpos = np.zeros(nkeys, np.int64)
    lc = np.zeros((nkeys, hl.size), np.float64)   # log2 decayed counts at last use
    n = np.zeros(nkeys, np.int64)
    log2n = np.zeros(nkeys, np.float64)
    gapsum = np.zeros(nkeys, np.float64)
    sb = np.zeros((nkeys, 5), np.int64)           # static bins: mgap, lgap, rank, n, mgap coarse
    nxt = np.full(nkeys, NEVER, np.int64)
    ptr = ustart.copy()                            # index of each key's next use in usteps
    stamp = np.full(nkeys, -1, np.int64)
    slot = np.full(nkeys, -1, np.int64)            # index in res, -1 = not resident
    res = np.empty((parts, cap), np.int64)
    used = np.zeros(parts, np.int64)
    ema = np.zeros(L, np.float64)
    b = np.zeros(NFb, np.int64)
    rows = np.zeros((maxrows if sample_p > 0 else 1, NFb), np.int16)
    dtn = np.zeros(maxrows if sample_p > 0 else 1, np.int64)
    nrows = 0
    misses = 0
    cur = L - 1
    for s in range(keys.shape[0]):
        cur = 0 if cur == L - 1 else cur + 1
        p = 0 if parts == 1 else cur
        row = keys[s]
        cnt = 0
        reuse = 0
        for j in range(K):
            k = row[j]
            if k >= 0:
                stamp[k] = s
                cnt += 1
                if last[k] == s - L:
                    reuse += 1
        log2P = math.log2(s / L + 1.0)
        for j in range(K):
            key = row[j]
            if key < 0:
                continue
            if slot[key] < 0:
                misses += 1
                if used[p] == cap:
                    collect = sample_p > 0 and nrows + cap <= maxrows and np.random.random() < sample_p
                    best = -1
                    bscore = 0.0
                    blast = 0
                    for i in range(cap):
                        r = res[p, i]
                        if stamp[r] == s:
                            continue
                        sc = 0.0
                        if mode == 2 or collect:
                            _bins(r, s, cur, L, E, last, lc, log2n, log2P, sb, ema, agebin, hl, b)
                            if mode == 2:
                                for f in range(NFb):
                                    sc += tab[f, b[f]]
                            if collect:
                                for f in range(NFb):
                                    rows[nrows, f] = b[f]
                                dtn[nrows] = nxt[r] - s
                                nrows += 1
                        if mode == 1:
                            lo = ptr[r]
                            hi = uend[r]
                            lim = s + W * L
                            c = 0
                            while lo + c < hi and usteps[lo + c] <= lim:
                                c += 1
                            sc = float(c)
                        if best < 0 or sc < bscore or (sc == bscore and lastpos[r] < blast):
                            best, bscore, blast = r, sc, lastpos[r]
                    # evict best (every step has at most K <= cap keys, so one exists)
                    i = slot[best]
                    used[p] -= 1
                    moved = res[p, used[p]]
                    res[p, i] = moved
                    slot[moved] = i
                    slot[best] = -1
                res[p, used[p]] = key
                slot[key] = used[p]
                used[p] += 1
            # learn from the use
            if last[key] >= 0:
                gap = (s - last[key]) / L
                for h in range(hl.size):
                    lc[key, h] = math.log2(2.0 ** (lc[key, h] - gap / hl[h]) + 1.0)
                gapsum[key] += gap
                mg = gapsum[key] / n[key]
                sb[key, 0] = 1 + _clip(int(math.floor(2.0 * math.log2(mg))), 0, 25)
                sb[key, 1] = 1 + _clip(int(math.floor(2.0 * math.log2(gap))), 0, 25)
                sb[key, 4] = 1 + _clip(int(math.floor(math.log2(mg))), 0, 12)
            else:
                for h in range(hl.size):
                    lc[key, h] = 0.0
            n[key] += 1
            log2n[key] = math.log2(n[key])
            sb[key, 2] = min(j, 7)
            sb[key, 3] = _clip(int(2.0 * log2n[key]), 0, 26)
            last[key] = s
            lastpos[key] = s * K + j
            nxt[key] = nexts[s, j]
            ptr[key] += 1
        if cnt > 0:
            ema[cur] = 0.9 * ema[cur] + 0.1 * reuse / cnt
    return misses, rows[:nrows], dtn[:nrows]


# -- driver ---------------------------------------------------------------------
class Trace:
    def __init__(self, name, tokens=0):
        self.name = name
        self.prep = Prepared(load(name, tokens))
        self.keys = self.prep.keys
        self.nexts = self.prep.nexts
        self.L, self.E = self.prep.L, self.prep.E
        flat = self.keys.ravel()
        steps = np.repeat(np.arange(self.keys.shape[0], dtype=np.int64), self.keys.shape[1])
        ok = flat >= 0
        order = np.lexsort((steps[ok], flat[ok]))
        self.usteps = steps[ok][order]
        nk = self.L * self.E
        cnt = np.bincount(flat[ok], minlength=nk)
        self.uend = np.cumsum(cnt).astype(np.int64)
        self.ustart = (self.uend - cnt).astype(np.int64)
        self._base = {}

    def run(self, part, slots, mode, tab=None, W=0, sample_p=0.0, maxrows=0, seed=0):
        parts = 1 if part == "global" else self.L
        cap = slots if part == "global" else slots // self.L
        t = np.zeros((NF, MAXB)) if tab is None else tab
        return _replay(self.keys, self.nexts, self.L, self.E, parts, cap, mode, t, W,
                       self.ustart, self.uend, self.usteps, sample_p, maxrows, seed, AGEBIN, HL)

    def base(self, part, slots):
        """(belady, lru, next-use) misses, cached."""
        if (part, slots) not in self._base:
            self._base[part, slots] = tuple(replay(self.prep, p, slots, part).misses
                                            for p in ("belady", "lru", "next-use"))
        return self._base[part, slots]


def validate():
    from expertcache.sim.replay import replay as rp
    tr = Trace("code", 300)
    for part, slots in CONFIGS:
        mine = tr.run(part, slots, 0)[0]
        table = rp(tr.prep, "lru", slots, part, engine="table").misses
        fast = rp(tr.prep, "lru", slots, part).misses
        print(f"300 tokens {part} {slots}: scan-kernel {mine}  SlotTable {table}  fast {fast}  "
              f"{'OK' if mine == table == fast else 'MISMATCH'}", flush=True)
    tr = Trace("code")
    t0 = time.time()
    mine = tr.run("global", 768, 0)[0]
    acc = int((tr.keys >= 0).sum())
    print(f"full code global 768: scan-kernel LRU hit rate {1 - mine / acc:.4f} (README 0.6297), "
          f"fast lru misses {tr.base('global', 768)[1]} vs {mine} ({time.time() - t0:.1f}s)")


def table_row(name, vals):
    return f"| {name} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | **{np.mean(vals):.3f}** |"


def header(tr):
    print(f"\n{tr.name} ({tr.keys.shape[0] // tr.L} tokens): misses / Belady's")
    print("| policy | " + " | ".join(f"{p} {s}" for p, s in CONFIGS) + " | average |")
    print("|---|" + "---|" * (len(CONFIGS) + 1))
    bl = [tr.base(p, s) for p, s in CONFIGS]
    print(table_row("lru", [b[1] / b[0] for b in bl]))
    print(table_row("next-use", [b[2] / b[0] for b in bl]), flush=True)
    return bl


def oracle(names, tokens):
    for name in names:
        tr = Trace(name, tokens)
        bl = header(tr)
        for W in (1, 4, 16, 64):
            vals = [tr.run(p, s, 1, W=W)[0] / b[0] for (p, s), b in zip(CONFIGS, bl)]
            print(table_row(f"oracle uses in next {W} passes", vals), flush=True)


# -- fitting --------------------------------------------------------------------
def design(rows, feats):
    from scipy import sparse
    offs, cols, off = [], [], 0
    for f in feats:
        cols.append(rows[:, f].astype(np.int64) + off)
        offs.append(off)
        off += NBINS[f]
    m = len(feats)
    data = np.ones(rows.shape[0] * m, np.float32)
    indptr = np.arange(0, rows.shape[0] * m + 1, m, dtype=np.int64)
    X = sparse.csr_matrix((data, np.stack(cols, 1).ravel(), indptr), shape=(rows.shape[0], off))
    return X, offs


def fit(rows, dtn, L, target, feats):
    """Lookup tables (NF x MAXB) of an additive score; higher = keep."""
    from sklearn.linear_model import LogisticRegression, Ridge
    X, offs = design(rows, feats)
    if target == "logt":
        y = np.log2(1.0 + np.minimum(dtn / L, 20000.0))
        m = Ridge(alpha=1.0, solver="sparse_cg", max_iter=500).fit(X, y)
        coef = -m.coef_.ravel()
    else:
        y = dtn <= int(target) * L
        m = LogisticRegression(C=1.0, max_iter=300, tol=1e-5).fit(X, y)
        coef = m.coef_.ravel()
    tab = np.zeros((NF, MAXB))
    for f, o in zip(feats, offs):
        tab[f, :NBINS[f]] = coef[o:o + NBINS[f]]
    return tab


def learn(tokens, targets, ablate, rows_per_config=600_000, save=None):
    code = Trace("code", tokens)
    gen = Trace("general", tokens)
    bl_c = header(code)
    bl_g = header(gen)
    allf = list(range(NF))
    data = {}
    t0 = time.time()
    for (part, slots), b in zip(CONFIGS, bl_c):
        cap = slots if part == "global" else slots // code.L
        p = min(1.0, rows_per_config / 2 / (b[1] * cap))
        m0, r0, d0 = code.run(part, slots, 0, sample_p=p, maxrows=rows_per_config // 2, seed=1)
        tab = fit(r0, d0, code.L, "2", allf)
        m1, r1, d1 = code.run(part, slots, 2, tab, sample_p=p, maxrows=rows_per_config // 2, seed=2)
        data[part, slots] = (np.concatenate([r0, r1]), np.concatenate([d0, d1]))
        print(f"# rows {part} {slots}: {len(r0)} (LRU-driven) + {len(r1)} (h=2 model, round 0: "
              f"{m1 / b[0]:.3f}x) [{time.time() - t0:.0f}s]", flush=True)
    if save:
        out = {}
        for (part, slots), b in zip(CONFIGS, bl_g):
            cap = slots if part == "global" else slots // gen.L
            p = min(1.0, rows_per_config / 2 / (b[1] * cap))
            _, rg, dg = gen.run(part, slots, 0, sample_p=p, maxrows=rows_per_config // 2, seed=3)
            out[f"code {part} {slots} rows"], out[f"code {part} {slots} dtn"] = data[part, slots]
            out[f"general {part} {slots} rows"], out[f"general {part} {slots} dtn"] = rg, dg
        np.savez_compressed(save, **out)
    results = {}

    def evaluate(label, feats, target):
        vc, vg = [], []
        for (part, slots), bc, bg in zip(CONFIGS, bl_c, bl_g):
            rows, dtn = data[part, slots]
            tab = fit(rows, dtn, code.L, target, feats)
            vc.append(code.run(part, slots, 2, tab)[0] / bc[0])
            vg.append(gen.run(part, slots, 2, tab)[0] / bg[0])
        results[label] = (vc, vg)
        print(f"{label}: code " + " ".join(f"{v:.3f}" for v in vc) + f" avg {np.mean(vc):.3f} | "
              f"general " + " ".join(f"{v:.3f}" for v in vg) + f" avg {np.mean(vg):.3f} "
              f"[{time.time() - t0:.0f}s]", flush=True)
        return np.mean(vg)

    best, best_t = 9.0, None
    for target in targets:
        g = evaluate(f"GAM target {'log2 time to next use' if target == 'logt' else 'use within ' + target + ' passes'}",
                     allf, target)
        if g < best:
            best, best_t = g, target
    if ablate:
        for gname, fs in GROUPS.items():
            evaluate(f"ablate {gname} (target {best_t})", [f for f in allf if f not in fs], best_t)
    return results


def gbdt(path, hs=(2,)):
    """Prediction quality on held-out rows: GAM (one-hot logistic) vs a GBDT on the 1-D features.

    Trained on the code rows of each config, tested on the general trace's LRU-driven rows.
    If the GBDT barely beats the GAM, the GAM replay is close to the ceiling of these features.
    """
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss, roc_auc_score
    d = np.load(path)
    L = 48
    allf = list(range(NF))
    for part, slots in CONFIGS:
        rc, dc = d[f"code {part} {slots} rows"], d[f"code {part} {slots} dtn"]
        rg, dg = d[f"general {part} {slots} rows"], d[f"general {part} {slots} dtn"]
        for h in hs:
            yc, yg = dc <= h * L, dg <= h * L
            Xc, _ = design(rc, allf)
            Xg, _ = design(rg, allf)
            gam = LogisticRegression(C=1.0, max_iter=300, tol=1e-5).fit(Xc, yc)
            pg = gam.predict_proba(Xg)[:, 1]
            one = list(range(17))
            hgb = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.1, max_leaf_nodes=63,
                                                 early_stopping=False).fit(rc[:, one], yc)
            ph = hgb.predict_proba(rg[:, one])[:, 1]
            base = yc.mean()
            print(f"{part} {slots} h={h}: base rate code {base:.3f} general {yg.mean():.3f} | "
                  f"log loss GAM {log_loss(yg, pg):.4f} GBDT {log_loss(yg, ph):.4f} | "
                  f"AUC GAM {roc_auc_score(yg, pg):.4f} GBDT {roc_auc_score(yg, ph):.4f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("validate", "oracle", "learn", "gbdt"))
    ap.add_argument("traces", nargs="*", default=["code", "general"])
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--targets", nargs="+", default=["1", "2", "4", "8", "logt"])
    ap.add_argument("--ablate", action="store_true")
    ap.add_argument("--save", help="save the sampled rows (npz) for the gbdt check")
    a = ap.parse_args(argv)
    if a.what == "validate":
        validate()
    elif a.what == "oracle":
        oracle(a.traces, a.tokens)
    elif a.what == "gbdt":
        gbdt(a.traces[0])
    else:
        learn(a.tokens, a.targets, a.ablate, save=a.save)


if __name__ == "__main__":
    main()
