"""The one-ggml-graph decode over the RAM tier (``runtime/ggmltier.py``, issues 32 and 33).

The graph reads the tier's rows through row ids, runs in segments split after each router and
reads the missing experts (and the next layer's guessed ones) between them. It must give the
tokens of the resident graph (logits bit for bit: the same ``mul_mat_id`` on the same bytes)
and of the per-layer tiered path, and step the tier as that path does (sim equals live:
``tests/test_tiers.py::test_tokens_equal_all_in_ram_and_sim_equals_live``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

import expertcache  # noqa: E402
from expertcache.integrations.record import record  # noqa: E402
from expertcache.quant import ggml, ggmlrepack  # noqa: E402
from expertcache.sim.tiers import replay_tiers  # noqa: E402
from gguf_models import write_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(not ggml.available()[0], reason=f"ggml kernels: {ggml.available()[1]}")

PROMPT = torch.tensor([[5, 9, 77, 120, 3, 44, 200, 17]])
NEW = 10
KW = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("ggml_tier") / "tiny.gguf", "qwen3_moe", "Q8_0", layers=3, experts=16)


def _tiered(path, budget=0.25, **kw):
    return expertcache.offload(path, device="cpu", baseline="resident", host_memory="tiered", host_budget=budget,
                               **kw)


def _tier_graph_equals_the_references(path):
    """The tier's graph run of ``path``: every step in the graph, logits bit for bit the resident
    graph's, tokens the per-layer tier's. Returns (the model, its tier's counters)."""
    ref = expertcache.offload(path, device="cpu", baseline="resident", host_memory="copy").generate(PROMPT, **KW)
    eager = _tiered(path, cpu_graph="off").generate(PROMPT, **KW)
    model = _tiered(path)
    summary = model.expertcache.summary()
    assert summary["cpu_graph"] == "on" and "experts from the RAM tier's rows" in summary["cpu_graph_reason"]
    got = model.generate(PROMPT, **KW)
    decoder = model._expertcache_graph
    assert decoder.steps == NEW - 1 and decoder.prefills == 1   # the prompt and every step in the graph
    assert torch.equal(got.sequences, ref.sequences) and torch.equal(got.sequences, eager.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))  # bit for bit
    tier = model.expertcache.stats().pool["tier"]
    assert tier["decode"]["file_reads"] > 0 and tier["decode"]["ram_hits"] > 0
    return model, tier


def test_tier_graph_equals_the_resident_graph_and_the_eager_tier(model_file):
    # Q8_0 experts: ggml repacks none on x86 (nor with cpu_repack='off'), so the tier's rows hold
    # the file's bytes and the graph reads them with the resident graph's in-place kernel
    model, tier = _tier_graph_equals_the_references(model_file)
    ahead = tier["prefetch"]
    # decode steps x MoE layers (the first guessed from the token's embedding) x top-k
    assert ahead["guessed"] == (NEW - 1) * 3 * 2
    assert 0 <= ahead["precision_embedding"] <= 1 and 0 <= ahead["precision"] <= 1  # each kind scored
    assert ahead["read_ahead"] > 0 and ahead["used"] > 0  # guesses were read ahead, and some loaded
    assert "read ahead" in model.expertcache.tier.summary_line()


@pytest.mark.parametrize("family,experts", [("deepseek_v3", "Q8_0"), ("mixtral", "Q8_0"), ("olmoe", "Q8_0"),
                                            ("gpt_oss", "MXFP4")])
def test_other_families_tier_graph_equals_the_resident_graph_and_the_eager_tier(tmp_path, family, experts):
    """DeepSeek-V3 (a dense first layer, then MoE layers with group-limited sigmoid routing and a
    shared expert), Mixtral (top-k renormalised) and OLMoE (q/k norms over all heads) over the RAM
    tier: the segments split after their routers, the experts read from the tier's rows. GPT-OSS
    (4 layers: sliding and full in turn) adds expert biases, rows of the tier as its weights."""
    path = write_gguf(tmp_path / f"{family}.gguf", family, experts, layers=4 if family == "gpt_oss" else 3)
    _, tier = _tier_graph_equals_the_references(path)
    assert tier["prefetch"]["guessed"] > 0  # the next layers' guesses ran (DeepSeek: in the kept groups)


@pytest.mark.parametrize("reader", ["aio", "aio-late", "threads"])
def test_read_ahead_changes_no_count_and_no_logit(model_file, monkeypatch, reader):
    """The table plans each step as without the guesses: the same hits and reads, the same logits;
    the guesses' used reads replace reads of the step, their wasted bytes are counted apart.
    Kernel AIO: a guess's reads start with no row and land in the one its step names, at once if
    done, else with the step's reads (``aio-late``: never polled, so most land so); reader
    threads: through staging rows."""
    from expertcache.runtime.kernelaio import AioPool

    if reader == "threads":
        monkeypatch.setenv("EXPERTCACHE_AIO", "0")
    if reader == "aio-late":
        monkeypatch.setattr(AioPool, "poll", lambda self: None)
    runs = []
    for ahead in (True, False):
        model = _tiered(model_file)
        prefetch = model._expertcache_graph.prefetch
        if reader != "threads" and not prefetch.direct:
            pytest.skip(f"no kernel AIO here: {model.expertcache.tier.reader.kind}")
        assert prefetch.direct == (reader != "threads") and bool(prefetch.staging) == (reader == "threads")
        if ahead:
            model._expertcache_graph.prefetch.min_precision = 0.0   # read every guess, however poor
        else:
            model._expertcache_graph.spec.prefetch = None
        out = model.generate(PROMPT, **KW)
        tier = model.expertcache.stats().pool["tier"]
        d = tier["decode"]
        if ahead:  # every guessed expert missing from the tier was read; those a step loaded were used
            p = tier["prefetch"]
            assert p["read_ahead"] == p["guessed_missing"] > 0
            assert p["used"] == p["guessed_right"] > 0
            assert p["used"] + p["wasted"] + p["pending"] == p["read_ahead"]
            assert p["used_late"] <= p["used"]
            if reader == "aio-late":    # never polled: most landed with their step's reads
                assert p["used_late"] > 0
            if reader == "threads":     # through staging rows, each landed when taken
                assert p["used_late"] == 0
        runs.append((out, {k: d[k] for k in ("accesses", "ram_hits", "file_reads", "file_bytes")}))
        if not ahead:  # decode: the pairs of experts read now ran after the reads, the others while
            late = sum(graph.late_pairs for graph in model._expertcache_graph.graphs.values())
            assert late == d["file_reads"] > 0 and d["wait_seconds"] <= d["read_seconds"]
    (a, ca), (b, cb) = runs
    assert ca == cb
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_the_first_layers_guess_is_its_router_on_the_embedding(model_file):
    """No layer before the first MoE layer guesses it: its router on the token's embedding, through
    the router's norm (attention left out), as transformers' modules compute it."""
    model = _tiered(model_file)
    spec = model._expertcache_graph.spec
    layer = model.model.layers[0]
    for token in (5, 77, 200):
        with torch.no_grad():
            h = layer.post_attention_layernorm(model.model.embed_tokens(torch.tensor([[token]])))
            logits = torch.nn.functional.linear(h, layer.mlp.gate.weight)[0, 0]
        assert spec.first_guess(token) == (0, torch.topk(logits, 2).indices.tolist())


def test_read_ahead_gates_each_kind_of_guess_on_its_own_precision(model_file):
    """Guesses from the embedding that fail stop being read; the router's go on."""
    model = _tiered(model_file)
    prefetch, store = model._expertcache_graph.prefetch, model.expertcache.tier
    missing = [e for e in range(16) if store.table.slot_of(1 * 16 + e) is None
               and store.table.slot_of(2 * 16 + e) is None][:2]
    assert len(missing) == 2
    prefetch.precision["embedding"] = 0.1         # below min_precision (0.5)
    prefetch.issue(1, missing, source="embedding")
    assert not prefetch.batch and prefetch.guess == set(missing)   # scored, not read
    prefetch.issue(2, missing)                    # the last guess scored (none loaded): lower still
    assert prefetch.precision["embedding"] < 0.1 and set(prefetch.batch) == set(missing)
    prefetch.drain()
    stats = prefetch.stats()
    assert prefetch.wasted == 2 and stats["precision"] == 0.8 and stats["precision_embedding"] == 0.08


def test_a_step_wider_than_the_tier_reads_into_a_compact_copy(model_file):
    """3 rows: the 8-token prompt's steps need more; the graph reads those layers' experts from the
    step's compact copy, and the tokens equal the resident run's."""
    ref = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="copy",
                              cpu_repack="off").generate(PROMPT, **KW)
    model = _tiered(model_file, 3 / 48)
    assert model.expertcache.tier.rows == 3
    got = model.generate(PROMPT, **KW)
    assert model._expertcache_graph.prefills == 1
    assert model.expertcache.tier.table.stats().sums("prefill")["bypasses"] > 0
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))


def test_a_prompt_over_one_chunk_takes_the_eager_path_and_says_why(model_file):
    model = _tiered(model_file)
    decoder = model._expertcache_graph
    prompt = torch.arange(300).remainder(250).unsqueeze(0)
    model.generate(prompt, max_new_tokens=2, do_sample=False)
    assert decoder.eager_calls == {"a prompt over 256 tokens with the RAM tier (the tier steps a layer once "
                                   "a forward)": 1}
    assert decoder.steps == 1


def test_slots_with_a_tier_keep_the_per_layer_path(model_file):
    model = expertcache.offload(model_file, device="cpu", slots=8, host_memory="tiered", host_budget=0.25)
    summary = model.expertcache.summary()
    assert summary["cpu_graph"] == "off"
    assert "host_memory='tiered' with slots or baseline 'cpu'" in summary["cpu_graph_reason"]


# -- rows in ggml's repacked layout (Q4_0 experts: ggml repacks them on AVX2 and NEON) ------
PARTS = ["down.weight", "gate.weight", "up.weight"]


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("ggml_tier_q4") / "q4.gguf", "qwen3_moe", "Q4_0", layers=3, experts=16)


@pytest.fixture
def repack_rows():
    """Skip where this CPU's ggml repacks no Q4_0 expert (the layouts are per instruction set)."""
    if ggmlrepack.RowRepack.of(2, 32, 8) is None:   # Q4_0, 8 rows of one block
        pytest.skip("ggml repacks no Q4_0 weight on this CPU (no CPU_REPACK buffer, or no AVX2 / NEON layout)")


def test_rows_are_repacked_by_default(q4_file, repack_rows):
    model = _tiered(q4_file)
    assert "repacked for ggml's CPU kernels as they are read" in model.expertcache.summary()["cpu_graph_reason"]
    assert model.expertcache.stats().pool["tier"]["repacked"] == PARTS


@pytest.fixture(scope="module")
def q4_resident(q4_file):
    """The all-in-RAM graph's run, experts repacked (the default) and read in place."""
    return {repack: expertcache.offload(q4_file, device="cpu", baseline="resident", host_memory="copy",
                                        cpu_repack=repack).generate(PROMPT, **KW) for repack in ("auto", "off")}


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_repacked_rows_equal_the_resident_repacked_graph(q4_file, q4_resident, repack_rows):
    """The tier's rows repacked as they are read: the tier's graph runs the resident graph's
    repacked kernel on the same bytes, so its logits equal the resident repacked run's bit for
    bit; against the tier's rows read in place they differ by float rounding only (the repacked
    kernel sums in another order). cpu_repack='off' keeps the rows the file's bytes: the
    resident graph's in-place run, bit for bit."""
    model = _tiered(q4_file)
    summary = model.expertcache.summary()
    assert "experts from the RAM tier's rows (down.weight, gate.weight, up.weight repacked for ggml's CPU " \
           "kernels as they are read)" in summary["cpu_graph_reason"]
    got = model.generate(PROMPT, **KW)
    assert model._expertcache_graph.steps == NEW - 1
    tier = model.expertcache.stats().pool["tier"]
    assert tier["repacked"] == PARTS and tier["decode"]["file_reads"] > 0 and tier["decode"]["ram_hits"] > 0
    assert "rows of down.weight, gate.weight, up.weight repacked" in model.expertcache.tier.summary_line()
    ref = q4_resident["auto"]
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))

    plain = _tiered(q4_file, cpu_repack="off")
    assert "rows (read in place: cpu_repack='off')" in plain.expertcache.summary()["cpu_graph_reason"]
    assert plain.expertcache.stats().pool["tier"]["repacked"] == []
    off = plain.generate(PROMPT, **KW)
    assert torch.equal(off.sequences, got.sequences)
    assert all(_rel(a, b) < 1e-5 for a, b in zip(got.logits, off.logits))
    assert any(not torch.equal(a, b) for a, b in zip(got.logits, off.logits))  # the repacked kernel ran
    assert all(torch.equal(a, b) for a, b in zip(off.logits, q4_resident["off"].logits))


def test_repacked_rows_read_ahead_and_sim_equals_live(q4_file, q4_resident, repack_rows):
    """Guesses read ahead into staging rows (the file's bytes) are repacked when a step takes them:
    every guess read, the logits equal the run without read-ahead; the tier's counts equal sim's
    replay of the run's routing (recorded on the per-layer path, which reads the repacked rows too)."""
    runs = []
    for ahead in (True, False):
        model = _tiered(q4_file)
        if ahead:
            model._expertcache_graph.prefetch.min_precision = 0.0
        else:
            model._expertcache_graph.spec.prefetch = None
        out = model.generate(PROMPT, **KW)
        live = model.expertcache.stats().pool["tier"]
        runs.append((model, out, live))
    (model, a, live), (_, b, _) = runs
    assert live["prefetch"]["used"] > 0 and live["repacked"] == PARTS
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    assert torch.equal(a.sequences, q4_resident["auto"].sequences)
    cache = model.expertcache
    trace = record(model, PROMPT, NEW)
    sim = replay_tiers(trace, cache.tier.rows, "default", 0, "default", expert_bytes=cache.expert_bytes)
    for phase in ("prefill", "decode"):
        replayed = sim.to_dict()[phase]
        assert (live[phase]["accesses"], live[phase]["ram_hits"], live[phase]["file_reads"], live[phase]["tokens"]) \
            == (replayed["ram_accesses"], replayed["ram_hits"], replayed["file_reads"], replayed["tokens"]), phase


def test_the_per_layer_path_reads_repacked_rows(q4_file, q4_resident, repack_rows):
    """Forwards the graph does not take (here: all of them, the decoder disabled; a prompt over one
    chunk) run the per-layer kernels on the same rows, through ggml's repacked kernels: the tokens
    of the per-layer tier without the graph (rows the file's bytes, cpu_graph='off'), logits within
    float rounding of it (the plain kernel on repacked bytes would compute garbage)."""
    model = _tiered(q4_file)
    kernels = model.expertcache.kernels
    assert all(sorted(k.packed) == PARTS for k in kernels)
    model._expertcache_graph.enabled = False
    got = model.generate(PROMPT, **KW)
    assert model._expertcache_graph.steps == 0 and model.expertcache.stats().pool["tier"]["decode"]["file_reads"] > 0
    plain = _tiered(q4_file, cpu_graph="off")
    assert plain.expertcache.stats().pool["tier"]["repacked"] == [] and not plain.expertcache.kernels[0].packed
    ref = plain.generate(PROMPT, **KW)
    assert torch.equal(got.sequences, ref.sequences)
    # Not bit-equal: the repacked kernels quantize activations on their own (in blocks of rows).
    # On an AVX-512 EPYC the logits drift by 7e-4..2e-3 from one decode step on (3e-7 before it,
    # carried on by the KV cache); earlier Xeons stayed under 1e-5. Garbage would be ~1.
    assert all(_rel(a, b) < 1e-2 for a, b in zip(got.logits, ref.logits))
    assert any(not torch.equal(a, b) for a, b in zip(got.logits, ref.logits))  # the repacked kernel ran

    prompt = torch.arange(300).remainder(250).unsqueeze(0)  # over one chunk: the per-layer path
    want = expertcache.offload(q4_file, device="cpu", baseline="resident", host_memory="copy").generate(
        prompt, max_new_tokens=3, do_sample=False)
    model = _tiered(q4_file)
    assert torch.equal(model.generate(prompt, max_new_tokens=3, do_sample=False), want)
    assert model._expertcache_graph.steps == 2


def test_repacked_rows_in_a_step_wider_than_the_tier(q4_file, q4_resident, repack_rows):
    """3 rows: the prompt's steps bypass the tier into a compact copy, whose rows are copied from
    repacked rows or repacked as read: the resident repacked run's logits, bit for bit."""
    model = _tiered(q4_file, 3 / 48)
    got = model.generate(PROMPT, **KW)
    assert model.expertcache.tier.table.stats().sums("prefill")["bypasses"] > 0
    ref = q4_resident["auto"]
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))


# -- rows the pairs being read are computed on while their reads run --------------------
def _no_row_twice_a_token(rows: torch.Tensor, where: str) -> None:
    """ggml's repacked ``mul_mat_id`` holds each row once a token: rows [T, K] must not repeat in a row."""
    for t, token in enumerate(rows.tolist()):
        assert len(set(token)) == len(token), f"{where}: token {t} names a row twice: {token}"


def test_the_graph_computes_only_the_hits_beside_the_reads(q4_file, q4_resident, repack_rows, monkeypatch):
    """While a decode step's reads run, its subset segment computes the RAM hits' pairs alone, on
    rows no read writes, each row once (ggml's repacked ``mul_mat_id`` holds a row once a token:
    a row named twice overran its row table); once read, the other subset computes the read
    experts' pairs (with the rest of the layer, in one call). Every rank is computed once a
    step, and the logits are the resident repacked run's bit for bit."""
    from expertcache.runtime import ggmltier, tiered

    model = _tiered(q4_file, 0.15)
    step, beside = {}, []
    start, finish, subset = ggmltier._TierStepGraph._start, tiered.TieredStore.finish, ggmltier._TierStepGraph._subset

    def started(self, i, phase):
        ids, pending = start(self, i, phase)
        step.update(reading={pending.rows[e] for e in pending.reading}, done=False, ranks=[])
        return ids, pending

    def finished(self, pending):
        step["done"] = True
        return finish(self, pending)

    def checked(self, i, ranks, real, rest=False):
        rows = [real[k] for k in ranks]
        _no_row_twice_a_token(torch.tensor([rows]), f"a subset of layer {i}")
        assert rest == step["done"]  # the read pairs run with the rest of the layer
        if not step["done"]:   # beside the reads: no row a read writes
            assert not set(rows) & step["reading"], (rows, step["reading"])
            beside.append(len(ranks))
        step["ranks"] += ranks
        if step["done"]:       # the read pairs: with the hits', every rank once
            assert sorted(step["ranks"]) == list(range(len(real)))
        return subset(self, i, ranks, real, rest)

    monkeypatch.setattr(ggmltier._TierStepGraph, "_start", started)
    monkeypatch.setattr(tiered.TieredStore, "finish", finished)
    monkeypatch.setattr(ggmltier._TierStepGraph, "_subset", checked)
    got = model.generate(PROMPT, **KW)
    graph = model._expertcache_graph
    assert graph.steps == NEW - 1 and beside   # some steps computed their hits beside reads
    assert sum(g.late_pairs for g in graph.graphs.values()) > NEW
    ref = q4_resident["auto"]
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))


def test_a_read_error_in_the_graph_names_the_expert_and_stops_the_tier(q4_file, monkeypatch):
    """A read that fails while a decode step's payloads land ends the forward with the file, offset
    and expert named, once every read of the step is in. The rows that step was filling may hold
    other experts' bytes, so the tier refuses every later step, never computes them."""
    from expertcache.runtime import directio, tiered

    model = _tiered(q4_file, 0.15)
    land, calls = directio.DirectFile.land, [0]

    def failing(self, got, start, offset, dst, what, put=None):
        calls[0] += 1
        if calls[0] == 40:  # well into decode
            raise self.failed(5, what, dst.nbytes, offset)  # EIO
        return land(self, got, start, offset, dst, what, put)

    monkeypatch.setattr(directio.DirectFile, "land", failing)
    with pytest.raises(directio.ExpertReadError, match=r"reading layer \d+ expert \d+ .* failed: Input/output error"):
        model.generate(PROMPT, **KW)
    assert calls[0] > 40                           # the step's other reads landed too
    reader = model.expertcache.tier.reader
    assert not getattr(reader, "_flight", {})      # nothing left in flight (kernel AIO)
    monkeypatch.setattr(directio.DirectFile, "land", land)
    with pytest.raises(tiered.TierBrokenError, match=r"stopped after a failed step \(ExpertReadError: .*reading "
                                                      r"layer \d+ expert .*: reload the model"):
        model.generate(PROMPT, **KW)


def test_the_per_layer_path_computes_beside_the_reads_on_rows_of_their_own(q4_file, repack_rows, monkeypatch):
    """The per-layer tier's first pass (``tiered._overlapped``) names each expert being read by a
    spare row of its own too: over a prompt's tokens no row repeats within a token."""
    from expertcache.runtime.cpukernel import GgmlExperts
    from expertcache.runtime import tiered

    model = _tiered(q4_file, 0.15)
    model._expertcache_graph.enabled = False
    passes = []
    mlp = GgmlExperts._silu_mlp

    def checked(self, hidden, rows, tensors):
        _no_row_twice_a_token(rows.view(hidden.shape[0], -1), "the per-layer first pass")
        passes.append(1)
        return mlp(self, hidden, rows, tensors)

    monkeypatch.setattr(GgmlExperts, "_silu_mlp", checked)
    overlapped, original = [], tiered._overlapped
    monkeypatch.setattr(tiered, "_overlapped", lambda *a: overlapped.append(1) or original(*a))
    got = model.generate(PROMPT, **KW)
    assert overlapped and passes
    want = _tiered(q4_file, 0.15, cpu_graph="off").generate(PROMPT, **KW)
    assert torch.equal(got.sequences, want.sequences)


def test_stand_ins_are_spare_rows_or_none():
    """Each expert being read gets a row no expert of the step is in; too few spare rows: None."""
    from expertcache.runtime.tiered import Pending, TieredStore

    store = TieredStore.__new__(TieredStore)
    store.rows = 6
    pending = Pending({3: 0, 7: 2, 9: 4}, {7, 9}, 0)        # experts 3 (a hit), 7, 9 (read) in rows 0, 2, 4
    assert store.stand_ins(pending) == {7: 1, 9: 3}
    store.rows = 4
    pending = Pending({3: 0, 7: 1, 9: 2, 11: 3}, {7, 9}, 0)  # every row taken by the step
    assert store.stand_ins(pending) is None
