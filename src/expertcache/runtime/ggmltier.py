"""The one-ggml-graph decode (runtime/ggmlgraph.py) over the RAM tier (runtime/tiered.py).

``host_memory='tiered'`` keeps ``host_budget`` experts in rows of its own buffers
(``TieredStore.pool[part]`` ``[R, stride]``) and reads the rest from the file as steps need
them. Here the graph's ``mul_mat_id`` reads those rows: each MoE layer's expert weights are a
leaf over the pool (``[cols, rows, max(R, E)]``, row stride the pool's), and its ids are an
input of row numbers (``rid`` ``[K, T]``) that Python fills once the layer's routing is known.

So the graph runs in segments, split after each MoE router (the router's top-k is expanded
into the graph before the layer's experts; ``ggml_graph_add_node`` copies each span of nodes
into a graph of its own, all sharing the allocation the whole graph got):

    segment 0: embedding .. layer 0's attention and router
    -- Python: layer 0's top-k -> the tier's step (reads of the missing experts) -> rid_0
    segment 1: layer 0's experts .. layer 1's attention and router
    ...
    segment L: the last layer's experts, the final norm, the lm_head

A decode step's experts have segments of their own between the router and the rest of the
layer: A computes every pair (a step without reads), and subset j (j = 1 .. K-1) computes j of
the K pairs, read at the rows of an input [j] and ``set_rows`` into their ranks' places of A's
output. A step with reads runs the subset of its RAM hits' pairs while the reads run (on rows
no read writes), then the subset of the read experts' pairs once they are in; the weighted
sum follows in the resident graph's order. (``tiered._overlapped``, the per-layer path, computes
every pair beside the reads instead, those being read on spare rows: ``TieredStore.stand_ins``.)
The experts' last segment runs joined to the rest of the layer (and the next attention): A +
rest, or the read experts' subset + rest; one ggml call fewer a layer.

With kernel AIO (runtime/kernelaio.py) the reads are in the kernel when ``start`` returns (those
of experts missing from the tier even before the table plans the step), and their payloads land
on this thread in ``finish``. (Landing them on both of the graph's threads, in a ggml custom op
over a Python callback, was tried: 2% faster back to back, 4-6% slower right after another large
process ran, where the pool's worker, asleep on the GIL or in ``io_getevents``, woke late;
docs/tiers.md.) With reader threads the step's first reads are settled before the hits' subset
(``ReadPool.settle``): the graph's threads spin between nodes on every core, and a reader woken
after them waited for a core most of the compute.
The subsets run apart from A over one allocation, so the MoE input they read (``h``) is marked
an output: ggml's allocator would otherwise give its memory to later nodes.

The tier's step is the eager path's (``TieredStore.start`` / ``finish``: the same table, the
same order of steps), so its counters equal ``sim``'s replay as before. A step wider than the
tier (a prompt's bypasses) points the layer's leaves at the step's compact copy instead.

Read-ahead (decode steps): layer l+1's router applied to layer l's MoE input (the residual
stream changes little from one layer to the next) guesses layer l+1's experts, and the first
MoE layer's router on the token's embedding guesses that layer's before segment 0; those not
in the tier are read (by the tier's reader) while the segments before their layer compute.
When a step loads one of them, the read lands in the row the step names instead of being
started then (kernel AIO; with reader threads its bytes are copied from a staging row:
``Prefetch.take``); the table plans the step as without the guess, so hits, loads and
evictions do not change. ``stats()['tier']['prefetch']`` counts experts read ahead, those a
step used and the bytes read for nothing.

Repacked rows (``cpu_repack='auto'``): the rows of the parts ggml repacks hold ggml's repacked
layout, each expert repacked as it is read (``TieredStore.repack_rows``, quant/ggmlrepack.py
``RowRepack``), and the leaves over them are marked repacked, so ``mul_mat_id`` runs the
repacked kernel the resident graph runs; the per-layer kernels read the same rows repacked
(``GgmlExperts.read_repacked``) when a forward goes eager. Only here: without the graph the
tier's rows stay the file's bytes.

What the graph computes is what the resident graph computes (the same ``mul_mat_id`` on the
same bytes, one (token, expert) pair at a time): bit for bit against the resident graph with
the same ``cpu_repack`` (tests/test_ggml_tier.py).
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from ..quant import ggml
from ..quant import ggmlgraph as gg
from ..quant.ggml import _InitParams, _Tensor
from ..quant.ggmlgraph import GGML_TYPE_F32, GGML_TYPE_I32, GGML_TYPE_I64
from ..stats import DECODE, PREFILL
from .directio import ReadCounters
from .ggmlgraph import _CHUNK, GraphDecoder, Unsupported, _Spec, _StepGraph
from .ggmlgraph import attach as _attach

# the experts built here: SiLU(gate) * up, or GPT-OSS's with biases and the clamped SwiGLU
_TIER_FAMILIES = {"qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral", "olmoe", "gpt_oss"}
# ggml's poll for the segments' thread pool: workers spin this long (ggml's default) for the next
# segment instead of sleeping. Tier 25%, bench model, one process: 21.4-22.1 ms a decode token
# against 22.8-23.6 with poll 0 (docs/tiers.md).
SEGMENT_POLL = 50

_declared_for = None


def _declare() -> None:
    """The node-copying functions, declared on the handle loaded now (ggmlgraph._declare's reason)."""
    global _declared_for
    base = ggml._LIBS[0]
    if _declared_for is base:
        return
    P, T = ctypes.c_void_p, ctypes.POINTER(_Tensor)
    for name, restype, argtypes in [("ggml_graph_n_nodes", ctypes.c_int, [P]),
                                    ("ggml_graph_node", T, [P, ctypes.c_int]),
                                    ("ggml_graph_add_node", None, [P, T])]:
        fn = getattr(base, name)
        fn.restype, fn.argtypes = restype, argtypes
    _declared_for = base


class _TierSpec(_Spec):
    """The model as ``_Spec`` reads it, its experts in the RAM tier: ``moe['tier']`` lists each
    part's (ggml type, rows, cols, part name); ``moe['experts']`` is empty, so the load's repack
    copies none of them (the tier's rows are repacked as they are read: ``_repack_rows``)."""

    tiered = True

    def __init__(self, model, cache) -> None:
        if getattr(cache, "tier", None) is None:
            raise Unsupported("no RAM tier")
        if not cache.host_resident:
            raise Unsupported("host_memory='tiered' with slots or baseline 'cpu': the graph reads the tier's rows "
                              "in a resident run only")
        family = getattr(model.config, "model_type", None)
        if family not in _TIER_FAMILIES:
            raise Unsupported(f"{family} with the RAM tier: not built as one graph yet")
        super().__init__(model, cache)
        self.store = cache.tier
        self.prefetch: Prefetch | None = None  # set by the decoder
        for L in self.layers:
            if "moe" in L:
                kernel = cache.kernels[L["moe"]["index"]]
                parts = (*kernel.first.parts, *kernel.down.parts)  # gate, up (or gate_up), down
                L["moe"]["tier"] = [(kernel.part[p].fmt.ggml_type, *kernel.part[p].shape, p) for p in parts]
                if "biases" in L["moe"]:  # GPT-OSS: rows of the tier too, not the host's [E, n]
                    biases = (*kernel.first_bias.parts, *kernel.down_bias.parts)
                    L["moe"]["tier_biases"] = [(kernel.part[p].shape[0], p) for p in biases]
                    L["moe"]["biases"] = []
                L["moe"]["experts"] = []
        self.embed_module = model.get_input_embeddings()
        self.first_moe = next((L for L in self.layers if "moe" in L), None)

    def first_guess(self, token: int) -> tuple[int, list[int]]:
        """The first MoE layer's experts guessed from ``token``'s embedding alone: that layer's
        router on the embedding through the router's norm, the attention before it left out
        (the pre-attention guess of arXiv 2511.10676, without its trained map). No layer before
        it to guess from otherwise. (MoE layer index, top-k expert ids)."""
        L = self.first_moe
        moe, (w, eps) = L["moe"], L["post_norm"]
        with torch.no_grad():
            e = self.embed_module(torch.tensor([token]))[0].float()                   # [H]
            logits = moe["router"] @ (e * torch.rsqrt(e.square().mean() + eps) * w)     # [E]
            if "router_bias" in moe:
                logits += moe["router_bias"]
            if "sigmoid" in moe:  # DeepSeek: the biased sigmoid scores (groups left out)
                logits = logits.sigmoid() + moe["sigmoid"]["bias"]
            return moe["index"], torch.topk(logits, moe["top_k"]).indices.tolist()


class _TierStepGraph(_StepGraph):
    """``_StepGraph`` whose experts are rows of the RAM tier, run in segments (module docstring)."""

    def __init__(self, spec: _TierSpec, kv, tokens: int, n_threads: int, repacked=None, keep: int = 0) -> None:
        _declare()
        self._moe_specs = [L["moe"] for L in spec.layers if "moe" in L]
        self._splits: list[int] = []          # node count after each MoE layer's router
        self._rid: list[tuple] = []           # per MoE layer: (rid tensor, its address)
        self._leaves: list[dict] = []         # per MoE layer: part -> weight leaf over the pool
        self._guesses: list = []              # per MoE layer: the next layer's guessed top-k, or None
        self._a: list[int] = []               # decode, per MoE layer: the index of its segment A
        self._subsets: list[list] = []        # decode, per MoE layer: [j - 1] (rows [j], ranks [j]) of subset j
        super().__init__(spec, kv, tokens, n_threads, repacked, keep)
        T = tokens
        self._rid_views = [gg.int32_array(addr, (T, gg.ne(t)[0])) for t, addr in self._rid]        # [T, K]
        self._guess_views = [None if t is None else gg.int32_array(gg.view_src(t), (T, gg.ne(gg.view_src(t))[0]))
                             [:, :gg.ne(t)[0]] for t in self._guesses]                               # [T, K']
        self._segments(n_threads)
        self._held = None  # a compact copy the next segment reads (a step wider than the tier)
        self.late_pairs = 0  # decode pairs computed after their expert was read

    # -- build ---------------------------------------------------------------------------
    def _headers(self, spec: _TierSpec, tokens: int) -> int:
        """A decode step's subsets too: K - 1 of them a MoE layer, about 12 ops each (GPT-OSS's)."""
        subsets = 0 if tokens > 1 else sum(24 * (m["top_k"] - 1) for m in self._moe_specs)
        return super()._headers(spec, tokens) + subsets

    def _moe_experts(self, moe: dict, h, sel, w):
        """The segment ends once the router's ``sel`` [K, T] is computed (and, in decode, the next
        layer's guess); the experts read the tier's rows through ``rid`` [K, T], filled between."""
        # T tokens, H hidden, K top-k, R rows of the tier
        g, T, H = self.g, self.tokens, self.spec.hidden
        K, i = moe["top_k"], len(self.ids) - 1                                     # this MoE layer's rank
        guess = None
        if T == 1 and i + 1 < len(self._moe_specs):  # decode: guess the next layer's experts from h
            nxt = self._moe_specs[i + 1]
            nr = nxt["router"]
            logits = g.mul_mat(g.leaf(GGML_TYPE_F32, (H, nr.shape[0]), nr.data_ptr()), h)  # [E', 1]
            if "router_bias" in nxt:
                logits = g.add(logits, self._vec(nxt["router_bias"]))
            if "sigmoid" in nxt:  # DeepSeek: the top-k of the biased sigmoid scores in the kept groups
                guess = self._group_choice(nxt, logits)[1]                        # [K', 1]
            else:                 # a softmax keeps the logits' order
                guess = g.argsort_top_k(logits, nxt["top_k"])                      # [K', 1]
            g._base.ggml_set_output(gg.view_src(guess))                           # read after its segment
            g.expand(guess)
        self._guesses.append(guess)
        g.expand(sel)                                                              # the segment ends here
        self._splits.append(g._base.ggml_graph_n_nodes(g.graph))
        rid, addr = g.input(GGML_TYPE_I32, (K, T), 4)                              # [K, T] rows of the tier
        self._rid.append((rid, addr))
        store = self.spec.store
        rows = max(store.rows, store.num_experts)  # a compact copy (one step's experts) may be wider than R
        packers = {} if store.repack is None else store.repack[moe["index"]]
        leaves = {}
        for t, n, cols, p in moe["tier"]:
            leaves[p] = g.leaf(t, (cols, n, rows), store.pool[p].data_ptr(), stride=store.stride[p])  # [cols, n, R]
            if p in packers:  # rows in ggml's repacked layout: its repacked kernels read them
                packers[p].mark(leaves[p])
        for n, p in moe.get("tier_biases", ()):  # GPT-OSS: float32 biases [n] in each row
            leaves[p] = g.leaf(GGML_TYPE_F32, (n, rows), store.pool[p].data_ptr(), stride=store.stride[p])
        self._leaves.append(leaves)
        if T > 1:
            return self._sum_ranks(g.mul(self._pairs(moe, leaves, h, rid), w))
        # decode: segment A computes every pair (no reads), or the subset segments do: j of the K
        # pairs each (their rows, their ranks), the RAM hits' while the reads run, the read ones
        # after, each output set into its rank's place; then the weighted sum in the resident
        # graph's order, so the logits do not change
        g._base.ggml_set_output(h)  # the subsets run apart from A: their nodes must not reuse h's memory
        ex = self._pairs(moe, leaves, h, rid)                                     # [H, K, 1]
        g.expand(ex)
        self._a.append(len(self._splits))
        self._splits.append(g._base.ggml_graph_n_nodes(g.graph))                  # A ends
        out, subsets = g.reshape_2d(ex, H, K), []                                 # [H, K]
        for j in range(1, K):
            rows, rows_addr = g.input(GGML_TYPE_I32, (j, 1), 4)                   # [j, 1] the pairs' rows
            ranks, ranks_addr = g.input(GGML_TYPE_I64, (j,), 8)                   # [j] their ranks
            out = g.set_rows(out, g.reshape_2d(self._pairs(moe, leaves, h, rows), H, j), ranks)  # a view of ex
            g.expand(out)
            self._splits.append(g._base.ggml_graph_n_nodes(g.graph))              # subset j ends
            subsets.append((gg.int32_array(rows_addr, (j,)), gg.int64_array(ranks_addr, (j,))))
        self._subsets.append(subsets)
        return self._sum_ranks(g.mul(g.reshape_3d(out, H, K, 1), w))

    def _oai_experts(self, moe: dict, h, sel, w):
        return self._moe_experts(moe, h, sel, w)  # GPT-OSS: the same segments, its own pairs

    def _pairs(self, moe: dict, leaves: dict, h, rows):
        """Each pair's output [H, K, T], its weights (and GPT-OSS's biases: the tier holds them
        in each expert's row too) read at the tier's ``rows`` [K, T]."""
        weights = [leaves[p] for *_, p in moe["tier"]]
        if "swiglu_oai" in moe:
            return self._oai_pairs(moe, weights, [leaves[p] for _, p in moe["tier_biases"]], h, rows)
        return self._silu_pairs(weights, h, rows)

    def _segments(self, n_threads: int) -> None:
        """Each span of nodes between two routers as a graph of its own, planned for the same
        threads; one work buffer, the largest any of them needs. A decode layer's experts also
        run joined to the rest of the layer (one call fewer): A and the rest (``_a_rest``), and
        each subset with the rest (``_sub_rest[i][j - 1]``: the read experts' pairs)."""
        b, c, graph = self.g._base, self.g._cpu, self.g.graph
        bounds = [0, *self._splits, b.ggml_graph_n_nodes(graph)]
        spans = [list(range(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
        nodes = [[b.ggml_graph_node(graph, n) for n in span] for span in spans]
        joined = []
        self._a_rest, self._sub_rest = [], []
        for a, subsets in zip(self._a, self._subsets):
            rest = nodes[a + len(subsets) + 1]
            self._a_rest.append(len(nodes) + len(joined))
            joined.append(nodes[a] + rest)
            self._sub_rest.append([])
            for j in range(1, len(subsets) + 1):
                self._sub_rest[-1].append(len(nodes) + len(joined))
                joined.append(nodes[a + j] + rest)
        lists = nodes + joined
        size = sum(b.ggml_graph_overhead_custom(max(len(n), 1), False) for n in lists) + 4096
        self._ctx = b.ggml_init(_InitParams(size, None, True))
        self._segs = []
        # segments run back to back with a little Python between them (about 25 calls a decode
        # token): a pool of their own whose workers poll between graphs (ggml._threadpool)
        pool = ggml._threadpool(n_threads, SEGMENT_POLL)
        for group in lists:
            seg = b.ggml_new_graph_custom(self._ctx, max(len(group), 1), False)
            for node in group:
                b.ggml_graph_add_node(seg, node)
            self._segs.append((seg, c.ggml_graph_plan(seg, n_threads, pool)))
        self._seg_work = ctypes.create_string_buffer(max(max(p.work_size for _, p in self._segs), 1))
        for _, plan in self._segs:
            plan.work_data = ctypes.addressof(self._seg_work)
        self._seg_refs = [(seg, ctypes.byref(plan)) for seg, plan in self._segs]

    # -- run -------------------------------------------------------------------------------
    def _compute(self) -> None:
        cache, store, T = self.spec.cache, self.spec.store, self.tokens
        phase = cache.phase if cache.phase is not None else (PREFILL if T > 1 else DECODE)
        store.tokens[phase] += T                 # what the eager path counts at layer 0
        prefetch = self.spec.prefetch
        if prefetch is not None:
            prefetch.drain()                     # guesses of the last forward are spent
            if T == 1 and self.spec.first_moe is not None:  # the first MoE layer's, from the embedding
                prefetch.issue(*self.spec.first_guess(int(self._tok[0])), source="embedding")
        self._run(0)
        for i in range(len(self._moe_specs)):
            if T == 1:
                self._overlapped(i, phase)              # the layer's experts and the rest of the layer
            else:
                self._step(i, phase)
                self._run(1 + i)
        self._held = None

    def _run(self, i: int) -> None:
        seg, plan = self._seg_refs[i]
        status = self.g._compute(seg, plan)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status} (segment {i})")

    def _start(self, i: int, phase: int):
        """MoE layer i's routing is known: its experts into rows of the tier, reads of the missing
        ones started; the next layer's guessed experts read ahead. (ids [T, K], the step)."""
        store, prefetch = self.spec.store, self.spec.prefetch
        ids = self._ids_views[i]                                                    # [T, K] expert ids
        experts = list(dict.fromkeys(ids.reshape(-1).tolist()))  # rank order, as the eager step asks
        pending = store.start(self._moe_specs[i]["index"], experts, phase,
                              None if prefetch is None else prefetch.take)
        guess = self._guess_views[i]
        if prefetch is not None and guess is not None:  # queued behind this step's own reads
            prefetch.issue(self._moe_specs[i + 1]["index"], guess.reshape(-1).tolist())
        return ids, pending

    def _point(self, i: int, ids: np.ndarray, pending, stand_in: int | None = None) -> None:
        """Fill ``rid`` [T, K] with the experts' rows (``stand_in`` for those being read) and point
        the leaves at the rows they are in (the pool, or a compact copy)."""
        lut = np.zeros(self.spec.store.num_experts, np.int32)
        lut[list(pending.rows)] = list(pending.rows.values())
        if stand_in is not None:
            lut[list(pending.reading)] = stand_in
        self._rid_views[i][:] = lut[ids]                                            # [T, K] rows
        src = self.spec.store._np if pending.compact is None else pending.compact
        for p, leaf in self._leaves[i].items():
            leaf.contents.data = src[p].ctypes.data
        self._held = pending.compact  # alive until the segment reading it ran

    def _step(self, i: int, phase: int) -> None:
        """A prompt's step: wait for the reads, then the layer's experts read every row."""
        ids, pending = self._start(i, phase)
        self.spec.store.finish(pending)
        self._point(i, ids, pending)

    def _overlapped(self, i: int, phase: int) -> None:
        """A decode step, then the rest of the layer: with reads to wait for, the subset of the RAM
        hits' pairs computes while they run (on rows no read writes), and the subset of the read
        experts' pairs once they are in; else segment A computes every pair. ggml computes each
        (token, expert) pair on its own, so every pair's output is the one-pass output bit for bit."""
        store = self.spec.store
        ids, pending = self._start(i, phase)
        if pending.compact is not None:  # a compact copy: read first, the rows point into it
            store.finish(pending)
            self._point(i, ids, pending)
            self._run(self._a_rest[i])
            return
        # one token, rows of the pool: filled from lists (numpy's lookup-table fill, ``_point``,
        # cost about 50 us a call)
        experts = ids[0].tolist()                                                   # [K] expert ids
        real = [pending.rows[e] for e in experts]                                   # [K] rows
        for p, leaf in self._leaves[i].items():
            leaf.contents.data = store._np[p].ctypes.data
        self._held = None
        late = [k for k, e in enumerate(experts) if e in pending.reading]
        self.late_pairs += len(late)
        if not late or len(late) == len(experts):  # nothing to compute beside the reads
            store.finish(pending)
            self._rid_views[i][0] = real
            self._run(self._a_rest[i])
            return
        store.settle(pending)  # the readers on a core before the graph's threads take both
        self._subset(i, [k for k in range(len(experts)) if k not in late], real)
        store.finish(pending)
        self._subset(i, late, real, rest=True)

    def _subset(self, i: int, ranks: list[int], real: list[int], rest: bool = False) -> None:
        """MoE layer i's pairs of ``ranks`` alone, read at their rows of ``real`` [K] (``rest``:
        then the rest of the layer, in the same call)."""
        rows, where = self._subsets[i][len(ranks) - 1]
        rows[:] = [real[k] for k in ranks]
        where[:] = ranks
        self._run(self._sub_rest[i][len(ranks) - 1] if rest else self._a[i] + len(ranks))

    def __del__(self) -> None:
        if ggml._LIBS and getattr(self, "_ctx", None):
            self.g._base.ggml_free(self._ctx)
            self._ctx = None
        super_del = getattr(super(), "__del__", None)
        if super_del is not None:
            super_del()


class Prefetch:
    """Experts of the next MoE layer, guessed, read ahead by the tier's reader.

    With kernel AIO (runtime/kernelaio.py) a guess's reads start with no destination; a step
    that loads the expert names its row (``TieredStore.bind``), and the payload lands there
    (repacked where the rows are) as it would from the step's own read: at once if the read is
    done, else with the step's reads in ``finish``. Reads no step took land nowhere. With reader
    threads they go into ``width`` staging rows (``staging[part]`` ``[width, stride]``) and a
    load copies them out.

    One batch at a time: ``issue`` first drops what is left of the last batch (counted wasted;
    staging reads are waited for, they write rows the next batch reuses); ``take`` hands a step
    an expert it loads.

    Reads ahead only while they pay: every guess is scored (of the guessed experts missing from
    the tier, the share the step then loaded), read or not, and a batch is read while the recent
    precision (a moving average) of its kind of guess is at least ``min_precision``: the first
    MoE layer's, from the token's embedding (``source='embedding'``), can fail where the next
    layer's router on this layer's input (``'router'``) holds, and the other way round. A wasted
    read costs the disk and the cores what a used one saves (one expert each), so below about one
    in two the guesses slow decode down; a model whose layers route alike reads ahead, one that
    does not stops after a few tokens and is scored on."""

    def __init__(self, store, width: int, min_precision: float = 0.5) -> None:
        self.store, self.width, self.min_precision = store, width, min_precision
        self.direct = hasattr(store.reader, "bind")  # kernel AIO: reads land in the step's rows
        self.staging = {} if self.direct else {p: np.zeros((width, s), np.uint8) for p, s in store.stride.items()}
        self.layer: int | None = None
        self.batch: dict[int, tuple[int, list, float]] = {}  # expert -> (staging row, reads, start)
        self.dropped: list = []        # AIO: reads of the last batch no step took, reaped at the next drop
        self.guess: set[int] = set()   # the last guess's experts missing from the tier (read or not)
        self.loaded = 0                # of those, loaded by their step
        self.precision = {"router": 1.0, "embedding": 1.0}  # moving averages of loaded / guessed-missing
        self.source = "router"         # the last guess's kind
        self.reset()

    def reset(self) -> None:
        self.guessed = 0     # experts guessed (top-k of the next layer's router on this layer's input)
        self.missing = 0     # of those, not in the tier when guessed
        self.right = 0       # of those, loaded by their step (read ahead or not)
        self.read = len(self.batch)  # read ahead (in flight counted)
        self.used = 0        # read ahead and then loaded by their step
        self.late = 0        # of those, still in flight at their step (AIO: landed with the step's reads)
        self.wasted = 0      # read ahead and not loaded
        self.wasted_bytes = 0
        self.used_bytes = 0

    def issue(self, layer: int, experts: list[int], source: str = "router") -> None:
        self.drain()
        table = self.store.table
        base = layer * self.store.num_experts
        self.guessed += len(experts)
        missing = [e for e in experts if table.slot_of(base + e) is None][:self.width]
        self.missing += len(missing)
        self.layer, self.guess, self.loaded, self.source = layer, set(missing), 0, source
        if not missing or self.precision[source] < self.min_precision:
            return
        for f in self.store.files.values():  # a file changed under us: caught before reading from it
            f.check()
        for row, e in enumerate(missing):
            t0 = time.perf_counter()
            jobs = self.store.loose_jobs(layer, e) if self.direct else \
                self.store._jobs(layer, e, self.staging, row, plain=True)  # repacked when taken
            self.batch[e] = (row, self.store.reader.submit(jobs), t0)
        self.read += len(missing)

    def holds(self, layer: int, expert: int) -> bool:
        """Whether ``expert`` of ``layer`` is being read ahead (its step takes it, not reads it)."""
        return layer == self.layer and expert in self.batch

    def take(self, layer: int, expert: int, dst: dict[str, np.ndarray], row: int) -> ReadCounters | list | None:
        """Put ``expert`` into ``dst[part][row]`` if it was read ahead: its counters once there,
        or its reads (AIO, still in flight), bound to the row for the step to collect; None: not
        read ahead."""
        if layer != self.layer or expert not in self.guess:
            return None
        self.loaded += 1
        self.right += 1
        if expert not in self.batch:
            return None
        at, reads, t0 = self.batch.pop(expert)
        self.used += 1
        if self.direct:
            self.store.bind(layer, expert, reads, dst, row)
            self.used_bytes += sum(r.nbytes for r in reads)
            self.store.reader.poll()
            if any(not r.done() for r in reads):  # the step collects them with its own reads
                self.late += 1
                return reads
            return self.store.reader.collect(reads, t0)  # landed now: the step need not wait
        got = self.store.reader.collect(reads, t0)
        for p, rng in self.store.layers[layer].items():
            self.store.put(layer, p, dst[p][row], self.staging[p][at, :rng.nbytes])
        self.used_bytes += got.bytes
        return got

    def drain(self) -> None:
        """Score the last guess; drop its unused reads (wasted). Staging reads are waited for (they
        write rows the next batch reuses); AIO reads land nowhere, reaped one batch later."""
        if self.guess:
            self.precision[self.source] = 0.8 * self.precision[self.source] + 0.2 * self.loaded / len(self.guess)
        if self.dropped:
            self.store.reader.collect(self.dropped, time.perf_counter())
        self.dropped = []
        for _, reads, t0 in self.batch.values():
            self.wasted += 1
            if self.direct:
                self.dropped += reads
                self.wasted_bytes += sum(r.nbytes for r in reads)
            else:
                self.wasted_bytes += self.store.reader.collect(reads, t0).bytes
        self.batch, self.layer, self.guess, self.loaded = {}, None, set(), 0

    def stats(self) -> dict:
        return {"guessed": self.guessed, "guessed_missing": self.missing, "guessed_right": self.right,
                "precision": round(self.precision["router"], 3),
                "precision_embedding": round(self.precision["embedding"], 3), "min_precision": self.min_precision,
                "read_ahead": self.read, "used": self.used, "used_late": self.late, "wasted": self.wasted,
                "pending": len(self.batch),  # the last batch's unused reads: counted wasted at the next
                "used_bytes": self.used_bytes, "wasted_bytes": self.wasted_bytes,
                "staging_bytes": sum(a.nbytes for a in self.staging.values())}


class TierGraphDecoder(GraphDecoder):
    """``GraphDecoder`` over the RAM tier: the same forwards take the graph, except prompts
    over one chunk (the tier steps each layer once a forward, as ``sim`` replays it)."""

    _spec_class, _graph_class = _TierSpec, _TierStepGraph

    def __init__(self, model, cache, eager) -> None:
        super().__init__(model, cache, eager)
        width = max(moe["top_k"] for moe in (L["moe"] for L in self.spec.layers if "moe" in L))
        self.prefetch = self.spec.prefetch = cache.tier.ahead = Prefetch(cache.tier, width)
        rows = _repack_rows(self.spec, cache, cache.config.cpu_repack)
        self.note = (f"; experts from the RAM tier's rows ({rows}): the graph runs in segments split after "
                     "each router, the missing experts read from the file between them, the next layer's "
                     "guessed experts read ahead")

    def _refusal(self, args: tuple, kwargs: dict) -> str | None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.enabled and isinstance(ids, torch.Tensor) and ids.ndim == 2 and ids.shape[1] > _CHUNK:
            return f"a prompt over {_CHUNK} tokens with the RAM tier (the tier steps a layer once a forward)"
        return super()._refusal(args, kwargs)


def _repack_rows(spec: _TierSpec, cache, choice: str) -> str:
    """The tier's rows in ggml's repacked layout for the parts ggml repacks (llama.cpp's default
    for its weights, quant/ggmlrepack.py: +40% on the experts' matmuls), each expert repacked as
    it is read; the per-layer kernels then read them so too. The same bytes: no memory more, so
    'auto' always repacks. Returns what the rows hold (for ``cpu_graph_reason``)."""
    from ..quant.ggmlrepack import RowRepack

    if choice == "off":
        return "read in place: cpu_repack='off'"
    store = cache.tier
    packers: list[dict] = [{} for _ in range(store.num_layers)]
    for moe in (L["moe"] for L in spec.layers if "moe" in L):
        for ggml_type, rows, cols, part in moe["tier"]:
            packer = RowRepack.of(ggml_type, cols, rows)
            if packer is not None:
                packers[moe["index"]][part] = packer
    if not any(packers):
        return "read in place: no part of a type and shape ggml repacks on this CPU"
    store.repack_rows(packers)
    for index, packed in enumerate(packers):
        cache.kernels[index].read_repacked(packed)
    return f"{', '.join(store.repacked_parts())} repacked for ggml's CPU kernels as they are read"


def attach(model, cache, choice: str = "auto") -> tuple[str, str]:
    """``ggmlgraph.attach`` for a model whose experts live in the RAM tier."""
    return _attach(model, cache, choice, TierGraphDecoder)
