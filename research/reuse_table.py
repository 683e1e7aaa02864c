"""P(expert reused next token | age in tokens, uses in the last 32 tokens), per layer, code trace.

Run from the repository root: .venv/bin/python research/reuse_table.py [args]."""
import numpy as np
from expertcache.trace import load_trace
tr = load_trace(str(__import__("pathlib").Path(__file__).resolve().parents[2] / "shared" / "traces") + "/qwen3-30b-a3b-code.npz")
X = tr.experts  # L,T,k
L,T,k = X.shape; E=128
use = np.zeros((L,T,E), bool)
for l in range(L):
    use[l, np.arange(T)[:,None], X[l]] = True
# age in tokens at token t (since last use before t), count in last 16 tokens
import collections
tab = collections.defaultdict(lambda: [0,0])
last = np.full((L,E), -10**6)
cnt = np.zeros((L,E), int)
W=32
for t in range(1,T):
    u = use[:,t-1]
    last[u] = t-1
    cnt += u
    if t-1-W >= 0: cnt -= use[:, t-1-W]
    age = np.minimum(t - last, 99)
    nxt = use[:, t]
    if t < 200: continue
    for a in (1,2,3,4,6,8,16,32):
        m = age == a
        for c in (1,2,3,4,6,8,12,16,24,32):
            mm = m & (np.minimum(cnt, 32) >= c) & (np.minimum(cnt,32) < {1:2,2:3,3:4,4:6,6:8,8:12,12:16,16:24,24:32,32:99}[c])
            tab[(a,c)][0] += mm.sum(); tab[(a,c)][1] += (mm & nxt).sum()
print("rows: age; cols: count in last 32 tokens buckets")
cs=(1,2,3,4,6,8,12,16,24,32)
print("age", *[f"{c:>6}" for c in cs])
for a in (1,2,3,4,6,8,16,32):
    print(f"{a:3}", *[f"{tab[(a,c)][1]/max(1,tab[(a,c)][0]):6.3f}" for c in cs])
print("n")
for a in (1,2,3,4,6,8,16,32):
    print(f"{a:3}", *[f"{tab[(a,c)][0]:6d}" for c in cs])
