"""Can a layer's routing guess the next layer's RAM-tier misses? (issue 33's read-ahead)

On a real routing trace (Qwen3-30B-A3B, ../shared/traces), a RAM tier of ``rows`` experts
(LRU, global, token-major steps) and an online co-occurrence table A[l][a][b] (expert a at
layer l-1 and b at layer l in the same token). Before each step of layer l, the experts of
layer l-1 (known by then) score layer l's experts; the top ``g`` not in the tier are the guess.
Prints, per guess width, the precision (guessed experts the step then read) and the recall
(the step's reads that were guessed). The table warms up over the first 200 tokens.

    python research/affinity_readahead.py general 1536 2500
"""

import sys
from collections import OrderedDict

import numpy as np

trace, rows, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ex = np.load(f"../shared/traces/qwen3-30b-a3b-{trace}.npz")["experts"].astype(np.int64)   # [L, T, K]
L, T, K = ex.shape
E = 128
T = min(T, tokens)
A = np.zeros((L, E, E), np.float32)
tier: OrderedDict[int, None] = OrderedDict()
widths = (1, 2, 4, 8)
guessed, right, reads = dict.fromkeys(widths, 0), dict.fromkeys(widths, 0), 0
for t in range(T):
    for layer in range(L):
        chosen = ex[layer, t]
        keys = [layer * E + e for e in chosen]
        missing = {e for e, k in zip(chosen, keys) if k not in tier}
        if layer > 0 and t > 200:
            score = A[layer][ex[layer - 1, t]].sum(0)
            ranked = [b for b in np.argsort(-score) if layer * E + b not in tier]
            for g in widths:
                guessed[g] += g
                right[g] += len(set(ranked[:g]) & missing)
            reads += len(missing)
        for k in keys:
            tier.pop(k, None)
            tier[k] = None
        while len(tier) > rows:
            tier.popitem(last=False)
        if layer > 0:
            A[layer][np.ix_(ex[layer - 1, t], chosen)] += 1
print(f"{trace}: {rows} rows, {reads / (T - 201):.1f} reads a token")
for g in widths:
    print(f"guess {g} a layer: precision {right[g] / guessed[g]:.3f}, recall {right[g] / reads:.3f}")
