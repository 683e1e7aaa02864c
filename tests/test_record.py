"""Recording live routing traces, and replaying them to the live run's exact hits and misses."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from live_oracle import replay_live  # noqa: E402
from tiny_moe import FAMILIES, save_checkpoint, tiny_model  # noqa: E402

from expertcache import SlotTable  # noqa: E402
from expertcache.cli import main  # noqa: E402
from expertcache.integrations.record import record, record_trace  # noqa: E402
from expertcache.integrations.transformers import offload  # noqa: E402
from expertcache.trace.format import load_trace, save_trace  # noqa: E402

NEW = 7


@pytest.fixture(scope="module")
def plain():
    return tiny_model("olmoe")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(2, 96, (1, 10), generator=torch.Generator().manual_seed(5))


def test_record_shape_phases_and_meta(plain, ids, tmp_path):
    trace = record(copy.deepcopy(plain), ids, NEW)
    # the prompt's forward, then one forward per generated token except the last
    assert trace.experts.shape == (2, 10 + NEW - 1, 2)
    assert trace.phases.tolist() == [0] * 10 + [1] * (NEW - 1)
    assert trace.meta["num_experts"] == 8 and trace.meta["expert_bytes"] == (48 * 32 + 32 * 24) * 4
    assert len(np.unique(trace.experts)) > 2  # real routing, not a constant
    again = load_trace(save_trace(trace, tmp_path / "t.npz"))
    assert np.array_equal(again.experts, trace.experts) and np.array_equal(again.phase, trace.phase)
    assert again.weights.shape == trace.weights.shape
    # weights are the router's top-k softmax scores in rank order (OLMoE does not renormalise)
    w = trace.weights.astype(np.float32)
    assert ((w >= 0) & (w <= 1)).all() and (w[..., 0] >= w[..., 1]).all() and w.sum(-1).max() <= 1.001


def test_offloaded_model_routes_like_the_plain_one(plain, ids):
    live = offload(copy.deepcopy(plain), slots=3)
    assert np.array_equal(record(live, ids, NEW).experts, record(copy.deepcopy(plain), ids, NEW).experts)


@pytest.mark.parametrize("kwargs", [
    dict(slots=3),
    dict(slots=4, partition="per-layer", eviction="fifo"),
    dict(slots=5, eviction="slru", admission="second-hit", miss="cpu"),
    dict(slots=4, eviction="lfu", admission="window"),
], ids=["default", "fifo-per-layer", "slru-second-hit-cpu", "lfu-window"])
def test_replay_equals_live_run(plain, ids, kwargs):
    live = offload(copy.deepcopy(plain), **kwargs)
    trace = record(live, ids, NEW)
    cache = live.expertcache
    table = SlotTable(trace.num_layers, trace.num_experts, cache.table.slots,
                      eviction=kwargs.get("eviction", "default"), admission=kwargs.get("admission"),
                      partition=kwargs.get("partition", "global"), top_k=trace.top_k)
    replayed, observed = replay_live(trace, table).to_dict(), cache.stats().to_dict()
    for scope in ("prefill", "decode"):
        for field in ("accesses", "hits", "misses", "loads", "evictions", "bypasses"):
            assert replayed[scope][field] == observed[scope][field], (scope, field)
    assert [r["decode"]["hits"] for r in replayed["layers"]] == [r["decode"]["hits"] for r in observed["layers"]]
    assert observed["total"]["misses"] > 0


def test_simulator_replays_a_decode_trace_exactly(plain):
    """A one-token prompt is all decode steps: the simulator's token-major replay is the live order."""
    sim = pytest.importorskip("expertcache.sim")
    live = offload(copy.deepcopy(plain), slots=3, eviction="fifo")
    trace = record(live, torch.tensor([[7]]), 12)
    assert (trace.phases == 1).all()
    result = sim.replay(trace, "fifo", 3, "global")
    got, want = result.stats.total(), live.expertcache.stats().total()
    assert (got.hits, got.misses, got.loads, got.evictions) == (want.hits, want.misses, want.loads, want.evictions)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_logits_are_the_scores_the_model_chose_from(family, ids, tmp_path):
    trace = record(tiny_model(family), ids, 4, router_logits=True)
    L, T, _ = trace.experts.shape
    assert trace.logits.shape == (L, T, trace.num_experts) and trace.logits.dtype == np.float16
    assert np.abs(trace.logits).max() > 0.01  # real scores, not zeros
    logits = trace.logits.astype(np.float32)
    picked = np.zeros(logits.shape, bool)
    np.put_along_axis(picked, trace.experts.astype(np.int64), True, axis=-1)
    lowest_chosen = np.where(picked, logits, np.inf).min(-1)      # [L, T]
    highest_other = np.where(picked, -np.inf, logits).max(-1)     # [L, T]
    if family == "deepseek_v3":  # biased, group-limited choice: not always the top-k of the raw logits
        assert (lowest_chosen >= highest_other).mean() > 0.2
    else:  # softmax (or plain top-k) keeps the logits' order; >= because float16 may tie
        assert (lowest_chosen >= highest_other).all()
    back = load_trace(save_trace(trace, tmp_path / "t.npz"))
    assert np.array_equal(back.logits, trace.logits)
    assert np.array_equal(back.slice_tokens(3).logits, trace.logits[:, :3])
    assert record(tiny_model(family), ids, 2).logits is None  # opt-in: 2 bytes per expert per token


def test_record_rejects_bad_input(plain, ids):
    with pytest.raises(ValueError, match="one sequence"):
        record(plain, torch.cat([ids, ids]), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        record(plain, ids, 0)


def test_record_trace_and_its_cli(plain, tmp_path, capsys):
    save_checkpoint(plain, tmp_path / "ckpt")
    out = tmp_path / "trace.npz"
    trace = record_trace(tmp_path / "ckpt", "w1 w5 w9 w3 w7", out, 4)
    assert trace.experts.shape == (2, 5 + 3, 2) and trace.phases.tolist() == [0] * 5 + [1] * 3
    assert trace.logits is None and np.array_equal(load_trace(out).experts, trace.experts)
    prompt = tmp_path / "p.txt"
    prompt.write_text("w1 w5 w9 w3 w7")
    argv = ["trace", "record", str(tmp_path / "ckpt"), "--prompt-file", str(prompt),
            "--max-new-tokens", "4", "--router-logits", "-o", str(out)]
    assert main(argv) == 0 and load_trace(out).logits.shape == (2, 5 + 3, 8)
    assert f"wrote {out}: 2 MoE layers x 8 tokens (5 prompt)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="prompt is empty"):
        record_trace(tmp_path / "ckpt", "  ", out, 4)
    argv[4] = str(tmp_path / "missing.txt")
    assert main(argv) == 2 and "prompt file not found" in capsys.readouterr().err


def test_a_checkpoint_without_tokenizer_files_says_so(plain, tmp_path, capsys):
    """transformers would build an empty tokenizer from config.json; the prompt then encodes
    to no tokens and recording failed with 'cannot reshape tensor of 0 elements'."""
    plain.save_pretrained(tmp_path / "ckpt")  # weights only, no tokenizer
    code = main(["trace", "record", str(tmp_path / "ckpt"), "--prompt", "w1 w2", "-o",
                 str(tmp_path / "t.npz")])
    err = capsys.readouterr().err
    assert code == 2 and "no tokenizer in the checkpoint directory" in err, err
    assert not (tmp_path / "t.npz").exists()


def test_record_takes_a_gguf_file_like_offload(tmp_path, capsys):
    """`trace record model.gguf` said "checkpoint directory not found" (issue 17): record takes
    what offload takes. The trace is the GGUF model's own routing: an offloaded run of the same
    file with a small cache counts exactly the hits the replay of the recorded trace predicts."""
    from gguf_models import write_gguf

    from expertcache.sim.replay import replay

    gg = write_gguf(tmp_path / "tiny.gguf", "qwen3_moe", "Q8_0")
    out = tmp_path / "t.npz"
    assert main(["trace", "record", str(gg), "--prompt", "a b c d", "--max-new-tokens", "3",
                 "-o", str(out)]) == 0, capsys.readouterr().err
    trace = load_trace(out)
    assert trace.num_tokens >= 4 and (trace.phases == 1).sum() == 2  # 3 new tokens: 2 decode forwards
    model = offload(gg, slots=trace.num_layers * trace.top_k, eviction="lru", device="cpu")
    from expertcache.loaders import load_tokenizer
    ids = load_tokenizer(gg)("a b c d", return_tensors="pt").input_ids
    again = record(model, ids, 3)
    assert np.array_equal(again.experts, trace.experts)
    live = model.expertcache.stats().total()
    sim = replay(trace, "lru", trace.num_layers * trace.top_k).stats.total()
    assert (live.hits, live.misses) == (sim.hits, sim.misses)
