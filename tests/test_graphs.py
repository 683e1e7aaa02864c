"""Decode replayed from a captured graph (runtime/graphs.py), proven on the CPU: the whole
decode step compiled with ``torch.compile(fullgraph=True)`` over a transformers StaticCache,
the lagged policy between calls. Tokens and logits equal plain transformers and eager decode."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_moe import save_checkpoint, tiny_model  # noqa: E402

from expertcache.cli import main  # noqa: E402
from expertcache.integrations.transformers import offload  # noqa: E402
from expertcache.runtime import graphs as graphs_mod  # noqa: E402
from expertcache.runtime.sampling import Sampling  # noqa: E402

N = 6  # new tokens


@pytest.fixture(scope="module")
def qwen():
    return tiny_model("qwen3_moe")  # 2 MoE layers x 8 experts, top-2


def _ids(batch: int, seed: int = 0, length: int = 7):
    return torch.randint(2, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def _plain(model, ids):
    """Plain transformers: greedy tokens [B, N] and logits [N, B, V]."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=N, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits)


def _replayed(model, ids):
    """Tokens [B, N] and logits [N, B, V] from the captured runner, step by step."""
    graphs = model.expertcache.graphs
    runner = graphs.runner(model, ids.shape[0], ids.shape[1] + N)
    with torch.no_grad():
        logits = [runner.prefill(ids)]
        tokens = [logits[-1].argmax(-1)]
        for _ in range(N - 1):
            logits.append(runner.decode(tokens[-1]))
            tokens.append(logits[-1].argmax(-1))
    return torch.stack(tokens, 1), torch.stack(logits)


def _ops_backend(ops: list):
    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        return gm.forward
    return backend


@pytest.mark.parametrize("family,slots,batch", [
    ("qwen3_moe", "resident", 1), ("qwen3_moe", 8, 1), ("qwen3_moe", 4, 1),
    ("qwen3_moe", 16, 4), ("qwen3_moe", 8, 4), ("qwen3_moe", 4, 4), ("mixtral", 4, 1),
], ids=["qwen-resident-b1", "qwen-50-b1", "qwen-25-b1", "qwen-100-b4", "qwen-50-b4", "qwen-25-b4", "mixtral-25-b1"])
def test_replayed_decode_equals_plain_and_eager(qwen, family, slots, batch, monkeypatch):
    """One graph, no break, no expertcache op in it; tokens and logits equal plain transformers
    and the eager device planner at 100 / 50 / 25 % slots, 1 and 4 sequences."""
    import torch._dynamo as dynamo

    reference = qwen if family == "qwen3_moe" else tiny_model(family)
    ids = _ids(batch)
    tokens, logits = _plain(reference, ids)
    size = dict(baseline="resident") if slots == "resident" else dict(slots=slots, staging=2 * batch)
    eager = offload(copy.deepcopy(reference), planner="device", **size)
    eager_tokens, eager_logits = _plain(eager, ids)
    ops = []
    monkeypatch.setattr(graphs_mod, "CPU_BACKEND", _ops_backend(ops))
    dynamo.reset()
    dynamo.utils.counters.clear()
    model = offload(copy.deepcopy(reference), planner="device", graphs="on", **size)
    got_tokens, got_logits = _replayed(model, ids)
    assert torch.equal(got_tokens, tokens) and torch.equal(eager_tokens, tokens)
    assert torch.allclose(got_logits, logits, atol=1e-5) and torch.allclose(got_logits, eager_logits, atol=1e-5)
    graphs = model.expertcache.summary()["graphs"]
    assert graphs["captured"] == [batch] and graphs["replays"] == N - 1 and graphs["breaks"] == 0
    assert graphs["reason"] is None
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1 and not dynamo.utils.counters["graph_break"]
    assert ops and not any("expertcache" in op for op in ops)
    assert "scatter_reduce" in ops and any("cumsum" in op for op in ops)  # the device step is inside
    assert sum("embedding" in op for op in ops) == 1  # and so is the whole forward
    planner = model.expertcache.planner
    assert planner.device_forwards == N - 1  # every replay took the device path, policy between
    if slots == 4:
        decode = model.expertcache.stats().total("decode")
        assert decode.misses > 0 and decode.loads > 0  # the policy changed slots between replays


def test_static_cache_as_the_runner_uses_it(qwen):
    """Pins the transformers behaviour the runner relies on (5.17 on the GPU image, newer
    here): the cache argument's name, StaticCache(config=, max_cache_len=), tensors that keep
    their addresses across reset() and a new prefill (a captured graph reads them there)."""
    model = offload(copy.deepcopy(qwen), planner="device", slots=8, graphs="on")
    runner = model.expertcache.graphs.runner(model, 1, 20)
    assert runner.length >= 20 and runner.kv_name in ("cache", "past_key_values")
    with torch.no_grad():
        runner.prefill(_ids(1))
        assert runner.kv.get_seq_length() == 7
        ptrs = [layer.keys.data_ptr() for layer in runner.kv.layers]
        runner.prefill(_ids(1, seed=4, length=3))
    assert [layer.keys.data_ptr() for layer in runner.kv.layers] == ptrs
    assert runner.kv.get_seq_length() == 3 and int(runner.position) == 3


def test_planner_auto_takes_the_device_where_decode_is_captured(qwen):
    """planner='auto' (the default): the device planner where the step is captured, else the host
    planner, and the summary says which and why."""
    default = offload(copy.deepcopy(qwen), slots=8).expertcache.summary()  # graphs='auto' on the CPU
    assert default["planner"] == "host"
    assert default["planner_reason"].startswith("planner='auto': host, decode is not captured here")
    captured = offload(copy.deepcopy(qwen), slots=8, graphs="on")
    summary = captured.expertcache.summary()
    assert summary["planner"] == "device" and summary["planner_reason"].startswith("planner='auto' (decode captured)")
    assert captured.expertcache.graphs.reason is None  # capture runs: the planner it needs was chosen


def test_eager_fallbacks_say_why(qwen):
    host = offload(copy.deepcopy(qwen), slots=8, graphs="on", planner="host")
    assert "planner='device'" in host.expertcache.summary()["graphs"]["reason"]
    auto = offload(copy.deepcopy(qwen), slots=8, planner="device")  # graphs='auto' on the CPU
    assert "CUDA only" in auto.expertcache.summary()["graphs"]["reason"]
    off = offload(copy.deepcopy(qwen), slots=8, planner="device", graphs="off")
    assert off.expertcache.graphs.reason == "graphs='off': decode runs eagerly"
    on = offload(copy.deepcopy(qwen), slots=8, planner="device", graphs="on")  # staging: 2 a layer
    assert "a batch of 4 needs" in on.expertcache.graphs.refusal(on, 4, Sampling())
    assert on.expertcache.graphs.refusal(on, 1, Sampling()) is None
    on.generation_config.repetition_penalty = 1.3  # a processor the replayed loop does not run
    assert "repetition_penalty=1.3" in on.expertcache.graphs.refusal(on, 1, Sampling())
    with pytest.raises(ValueError, match="unknown graphs 'always'"):
        offload(copy.deepcopy(qwen), slots=8, graphs="always")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(tiny_model("qwen3_moe"), path)
    return path


def _cli(checkpoint, tmp_path, capsys, name, *extra):
    out = tmp_path / f"{name}.json"
    assert main(["generate", str(checkpoint), "--prompt", "w1 w2 w3 w4 w5", "--slots", "4", "--planner",
                 "device", "--max-new-tokens", "12", "--json", str(out), *extra]) == 0
    printed = capsys.readouterr().out
    return printed.split("\n\n")[0], printed, json.loads(out.read_text())


def test_cli_graphs_on_equals_off(checkpoint, tmp_path, capsys):
    """`generate --graphs on --json F` on the CPU: 0 breaks, the same tokens as --graphs off,
    a graphs line in the text summary; sampled with a seed and cut at a stop string alike."""
    off, _, off_json = _cli(checkpoint, tmp_path, capsys, "off", "--graphs", "off")
    on, printed, on_json = _cli(checkpoint, tmp_path, capsys, "on", "--graphs", "on")
    assert on == off and len(on.split()) == 12
    graphs = on_json["cache"]["graphs"]
    assert graphs["mode"] == "on" and graphs["active"] and graphs["breaks"] == 0 and graphs["replays"] == 11
    assert off_json["cache"]["graphs"]["reason"] == "graphs='off': decode runs eagerly"
    assert "graphs        on (torch.compile" in printed and "11 replays, 0 breaks" in printed
    assert on_json["decode_cold"]["tokens"] == 11 and on_json["decode_cold"]["hit_rate"] is not None
    # the decode counters move as in eager decode: same hits, same bytes
    assert on_json["cache"]["stats"]["decode"] == off_json["cache"]["stats"]["decode"]
    sampled = ("--temperature", "0.9", "--top-p", "0.8", "--top-k", "20", "--seed", "7")
    s_off, _, _ = _cli(checkpoint, tmp_path, capsys, "s_off", "--graphs", "off", *sampled)
    s_on, _, _ = _cli(checkpoint, tmp_path, capsys, "s_on", "--graphs", "on", *sampled)
    assert s_on == s_off and s_on != on
    stop = " ".join(on.split()[4:6])
    cut, _, _ = _cli(checkpoint, tmp_path, capsys, "cut", "--graphs", "on", "--stop", stop)
    assert stop not in cut and on.startswith(cut.rstrip())


@pytest.mark.slow  # 6-25 s a case on 2 busy cores: the transformers reference dequantizes the file
@pytest.mark.parametrize("qtype,down,slot_format", [
    ("Q8_0", None, "dequantized"), ("Q4_K", ["Q6_K", "Q4_K"], "dequantized"),
    ("Q4_K", ["Q6_K", "Q4_K"], "quantized")], ids=["q8_0-dequantized", "q4_k_m-dequantized", "q4_k_m-quantized"])
def test_gguf_slots_take_the_device_path(tmp_path, qtype, down, slot_format):
    """A GGUF's experts on the device path: staged and loaded as their bytes (each layer its
    own type, as in Q4_K_M); dequantized slots dequantize them as they land, quantized slots
    keep the bytes and dequantize the step's rows inside it. Eager and replayed decode equal
    transformers' own loading of the file."""
    import expertcache
    from gguf_models import write_gguf
    from test_gguf import reference

    from expertcache.ggufmodel.header import read_header

    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", qtype, **({"down_type": down} if down else {}))
    sizes = [read_header(path).layer_expert_bytes(b) for b in read_header(path).moe_blocks]
    prompt = torch.tensor([[5, 9, 77, 120, 3, 44, 200, 17]])
    ref = reference(path)
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=N, do_sample=False)[:, prompt.shape[1]:]
    settings = dict(slots=6, slot_format=slot_format, cpu_kernel="torch", planner="device")
    eager = expertcache.offload(path, **settings)
    assert eager.expertcache.summary()["planner"] == "device", eager.expertcache.planner_reason
    with torch.no_grad():
        got = eager.generate(prompt, max_new_tokens=N, do_sample=False)[:, prompt.shape[1]:]
    assert torch.equal(got, want)
    stats, planner = eager.expertcache.stats(), eager.expertcache.planner
    assert planner.device_forwards == N - 1 and stats.total("decode").misses > 0
    # decode bytes: each miss crosses once as its own layer's stored bytes, plus the loads
    # from the host (the table moved a resident expert to another slot: a relocation)
    assert planner.lagged.staged == stats.total("decode").misses
    host_loaded = sum(planner.copies[1]) - planner.lagged.staged
    assert host_loaded == planner.lagged.host_loads <= 1
    missed = sum(stats.layer(l, "decode").misses * sizes[l] for l in (0, 1))
    assert missed <= stats.h2d_bytes("decode") <= missed + host_loaded * max(sizes)
    replayed = expertcache.offload(path, graphs="on", **settings)
    tokens, _ = _replayed(replayed, prompt)
    assert torch.equal(tokens, want) and replayed.expertcache.graphs.summary()["breaks"] == 0
    assert replayed.expertcache.summary()["slot_format"] == slot_format


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_cuda_graph_decode_equals_plain(qwen, batch):
    """On CUDA: the step captured in a CUDA graph, replayed once a token; tokens equal plain
    transformers' and logits within 1e-4 at 25 % slots; the replays themselves make no sync
    (sync debug mode 'error' around them; the host's one wait a token is the token read)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ids = _ids(batch)
    tokens, logits = _plain(copy.deepcopy(qwen).to("cuda"), ids.to("cuda"))
    model = offload(copy.deepcopy(qwen), slots=4, staging=2 * batch, planner="device", graphs="auto",
                    device="cuda")
    graphs = model.expertcache.graphs
    assert graphs.how == "cuda-graph" and graphs.refusal(model, batch, Sampling()) is None
    runner = graphs.runner(model, batch, ids.shape[1] + N)
    with torch.no_grad():
        got = [runner.prefill(ids.to("cuda"))]
        picked = [got[-1].argmax(-1)]
        got.append(runner.decode(picked[-1]))      # captures
        picked.append(got[-1].argmax(-1))
        assert graphs.summary()["reason"] is None, graphs.summary()  # else decode fell back to eager
        for _ in range(N - 2):
            torch.cuda.synchronize()
            runner.fn = _no_sync(runner.fn)
            got.append(runner.decode(picked[-1]))
            picked.append(got[-1].argmax(-1))
    assert graphs.summary()["reason"] is None and graphs.summary()["breaks"] == 0, graphs.summary()
    assert torch.equal(torch.stack(picked, 1).cpu(), tokens.cpu())
    assert (torch.stack(got).cpu() - logits.cpu()).abs().max().item() <= 1e-4


def _no_sync(fn):
    if getattr(fn, "_checked", False):
        return fn

    def call(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    call._checked = True
    return call


def test_cuda_capture_protocol_with_fakes(monkeypatch):
    """The CUDA-only lines (graphs._cuda_graph) on fakes: two warm-ups on a side stream, each
    rewound (transformers' static layers advance their own position counter inside the step:
    5.17 and 5.2x alike), the capture, one replay; the state moves by exactly one step."""
    import contextlib
    import types

    counter, log = torch.zeros((), dtype=torch.long), []

    def step():
        counter.add_(1)
        log.append("step")

    kept = counter.clone()

    class FakeGraph:
        def replay(self):
            step()

    stream = types.SimpleNamespace(wait_stream=lambda other: log.append("wait"))
    fake = types.SimpleNamespace(Stream=lambda device: stream, current_stream=lambda device: stream,
                                 stream=lambda s: contextlib.nullcontext(), CUDAGraph=FakeGraph,
                                 graph=lambda g: contextlib.nullcontext())
    monkeypatch.setattr(graphs_mod.torch, "cuda", fake)
    replay = graphs_mod._cuda_graph(step, "cuda", lambda: counter.copy_(kept))
    assert int(counter) == 1 and log == ["wait", "step", "step", "wait", "step", "step"]
    replay()
    assert int(counter) == 2


def test_runner_rewinds_the_static_cache_counters(qwen):
    """What the rewind puts back: every static layer's position counter (a tensor in 5.17 and
    5.2x), found on the runner's own cache."""
    model = offload(copy.deepcopy(qwen), planner="device", slots=8, graphs="on")
    runner = model.expertcache.graphs.runner(model, 1, 20)
    with torch.no_grad():
        runner.prefill(_ids(1))
    counters = [layer.cumulative_length for layer in runner.kv.layers]
    assert all(isinstance(c, torch.Tensor) and int(c) == 7 for c in counters)
    rewind = runner._counters()
    for c in counters:
        c.add_(3)
    rewind()
    assert [int(c) for c in counters] == [7] * len(counters)


def test_cuda_captures_the_eager_step_where_dynamo_refuses(qwen, monkeypatch):
    """On CUDA a step dynamo cannot trace whole is still captured: the eager step itself (it
    reads nothing back), and the summary says how. Faked on the CPU: the compiled step raises a
    graph break, the capture is a plain call."""
    model = offload(copy.deepcopy(qwen), planner="device", slots=8, graphs="on")
    graphs = model.expertcache.graphs
    runner = graphs.runner(model, 1, 20)
    runner.cuda = True

    def refused(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("torch.* op returned non-Tensor (faked)")

    captured = []

    def fake_capture(step, device, rewind=lambda: None):
        step()
        captured.append(step)
        return step

    monkeypatch.setattr(graphs_mod.torch, "compile", lambda fn, **kw: refused)
    monkeypatch.setattr(graphs_mod, "_cuda_graph", fake_capture)
    with torch.no_grad():
        runner.prefill(torch.tensor([[5, 6, 7]]))
        runner.fn = runner._capture()
    assert captured == [runner._step] and runner.fn == runner._step   # the eager step, captured
    assert graphs.breaks == 1 and graphs.how.startswith("cuda-graph of the eager step (dynamo refused it")
    assert graphs.refused is None
