"""CPU decode as one ggml graph a token (``runtime/ggmlgraph.py``, issue 32) against today's
per-layer ggml path on the same loaded model (``GraphDecoder.enabled`` off).

Tolerance: with float32 weights (F32 experts and dense weights) the graph and the eager path
differ only in float rounding (ggml's RoPE, flash attention and norms against torch's):
relative L2 of the logits under 1e-5 (measured 8e-7), and greedy tokens equal. With quantized
weights both paths quantize each activation block to 8 bits before the dot products, so they
agree bit for bit until a 1e-7 rounding difference upstream flips one block's rounding; the
fixtures' random blocks (weights of std 20-80) turn such a flip into a jump of 2-6% in the
logits, which then stays in the KV cache. So quantized cases are compared teacher-forced (both
paths fed the eager path's greedy tokens): logits within 10% relative L2 at every step, and the
same top-1 token wherever the eager path's top-1 margin exceeds the largest logit difference.
"""

from __future__ import annotations

import pytest
import torch

import expertcache
from expertcache.quant import ggml
from expertcache.runtime import ggmlgraph
from gguf_models import write_gguf

pytestmark = pytest.mark.skipif(not ggml.available()[0], reason=f"ggml kernels: {ggml.available()[1]}")

FLOAT_TOL, STEP_TOL = 1e-5, 0.10
PROMPT = [[100, 101, 102, 103, 104]]
# (family, expert type, dense type): every type family the loader reads, both families
CASES = [("qwen3_moe", "F32", "F32"), ("qwen3_moe", "F16", "F16"), ("qwen3_moe", "Q8_0", "Q8_0"),
         ("qwen3_moe", "Q4_0", "Q4_K"), ("qwen3_moe", "Q4_K", "Q6_K"),
         ("qwen3_moe", "MXFP4", "F32"), ("qwen3_moe", "IQ4_XS", "Q8_0"),
         ("qwen2_moe", "Q8_0", "Q4_0"), ("qwen2_moe", "F32", "F32"),
         # Mixtral (its q/k un-permuted at load, kept as Q8_0 / Q4_K blocks), OLMoE (norms over all heads)
         ("mixtral", "F32", "F32"), ("mixtral", "Q4_K", "Q8_0"), ("mixtral", "Q8_0", "Q4_K"),
         ("olmoe", "F32", "F32"), ("olmoe", "Q8_0", "Q4_0"),
         # DeepSeek-V3: MLA (its cache the latent and k_pe), sigmoid routing over expert groups, a
         # dense first layer, a shared expert
         ("deepseek_v3", "F32", "F32"), ("deepseek_v3", "Q8_0", "Q8_0")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _decode(model, prompt, steps: int, past=None, first=None, forced=None):
    """Greedy tokens and each step's logits [steps, V] after a prompt; with
    ``forced``, step i is fed forced[i - 1] instead of its own choice (teacher forcing)."""
    tokens, logits = [], []
    with torch.no_grad():
        if past is None:
            out = model(torch.tensor(prompt), use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        else:
            tok = first
        for i in range(steps):
            if forced is not None and i:
                tok = torch.tensor([[forced[i - 1]]])
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            logits.append(out.logits[0, -1].clone())
            tokens.append(tok.item())
    return tokens, torch.stack(logits), past, tok


def _load(tmp_path, family="qwen3_moe", experts="Q8_0", dense="F32", **settings):
    path = write_gguf(tmp_path / f"{family}_{experts}_{dense}.gguf", family, experts, dense_type=dense)
    return expertcache.offload(path, device="cpu", **({"baseline": "resident"} | settings))


@pytest.mark.parametrize("family,experts,dense", CASES)
def test_graph_decode_equals_the_per_layer_path(tmp_path, family, experts, dense):
    model = _load(tmp_path, family, experts, dense)
    summary = model.expertcache.summary()
    assert summary["cpu_graph"] == "on", summary["cpu_graph_reason"]
    decoder = model._expertcache_graph
    decoder.enabled = False
    eager_tokens, eager_logits, _, _ = _decode(model, PROMPT, 12)
    eager_counts = model.expertcache.stats().sums(1)
    assert decoder.steps == 0
    model.expertcache.reset_stats()
    decoder.enabled = True
    exact = experts == dense == "F32"
    tokens, logits, past, _ = _decode(model, PROMPT, 12, forced=None if exact else eager_tokens)
    assert decoder.steps == 12                       # every decode step ran as one graph
    if exact:
        assert tokens == eager_tokens and _rel(logits, eager_logits) < FLOAT_TOL
    for step, (mine, ref) in enumerate(zip(logits, eager_logits)):
        assert _rel(mine, ref) < STEP_TOL, step
        top = ref.topk(2).values
        if top[0] - top[1] > (mine - ref).abs().max():
            assert mine.argmax() == ref.argmax(), step
    # the cache's counters see the graph's routing as they saw the eager path's
    counts = model.expertcache.stats().sums(1)
    assert counts["accesses"] == eager_counts["accesses"] and counts["hits"] == eager_counts["hits"] > 0
    # the caller's cache reads the graph's KV rows: [1, kv heads, prompt + 12, head dim] (DeepSeek:
    # [1, 1, n, latent] and [1, 1, n, rope dims]), and holds no tensors of its own (the eager
    # prefill's were dropped at the hand-over: the KV is held once)
    assert past.get_seq_length() == len(PROMPT[0]) + 12
    assert past.layers[0].keys.shape[2] == past.get_seq_length()
    assert past.layers[0].keys.data_ptr() == decoder.kv[0][0].data_ptr()
    assert not any(isinstance(v, torch.Tensor) for layer in past.layers for v in vars(layer).values())


def test_hand_over_both_ways_and_between_caches(tmp_path, monkeypatch):
    """The KV cache moves between the graph and the eager path (a multi-token step in the
    middle), grows past its capacity (2 rows at first here), and two caches decoded in turn
    each keep their own rows: the result equals the eager path throughout."""
    monkeypatch.setattr(ggmlgraph, "_MIN_CAPACITY", 2)
    model = _load(tmp_path, "qwen3_moe", "F32", "F32")
    decoder = model._expertcache_graph

    def run():
        a_tok, a_log, a_past, a_next = _decode(model, PROMPT, 4)
        with torch.no_grad():                                            # 3 tokens: the eager path
            out = model(torch.tensor([[7, 8, a_next.item()]]), past_key_values=a_past, use_cache=True)
        b_tok, b_log, _, _ = _decode(model, [[50, 51]], 5)               # another cache in between
        c_tok, c_log, _, _ = _decode(model, None, 6, a_past, out.logits[:, -1:].argmax(-1))
        return a_tok + b_tok + c_tok, torch.cat([a_log, b_log, c_log])

    decoder.enabled = False
    eager_tokens, eager_logits = run()
    decoder.enabled = True
    tokens, logits = run()
    assert decoder.steps == 15 and decoder.capacity >= 16
    assert tokens == eager_tokens
    assert _rel(logits, eager_logits) < FLOAT_TOL


def test_rows_past_the_cache_are_never_read(tmp_path):
    """KV rows beyond the cache's length are masked; ggml skips them: NaN there changes nothing."""
    model = _load(tmp_path, "qwen3_moe", "F32", "F32")
    decoder = model._expertcache_graph
    tokens, logits, past, tok = _decode(model, PROMPT, 3)
    n = past.get_seq_length()
    for k, v in decoder.kv:
        k[n:], v[n:] = float("nan"), float("nan")
    more, more_logits, _, _ = _decode(model, None, 4, past, tok)
    decoder.enabled = False
    eager, eager_logits, _, _ = _decode(model, PROMPT, 7)
    assert torch.isfinite(more_logits).all()
    assert tokens + more == eager
    assert _rel(torch.cat([logits, more_logits]), eager_logits) < FLOAT_TOL


def test_forwards_the_graph_does_not_take_run_eagerly(tmp_path):
    model = _load(tmp_path, "qwen3_moe", "Q8_0", "F32")
    decoder = model._expertcache_graph
    with torch.no_grad():
        out = model(torch.tensor(PROMPT), use_cache=True)                     # prefill
        model(torch.tensor([[1], [2]]))                                       # a batch of 2
        model(torch.tensor([[5]]), past_key_values=out.past_key_values, use_cache=True,
              attention_mask=torch.tensor([[0] + [1] * len(PROMPT[0])]))     # padding
    model(torch.tensor([[5]]), past_key_values=out.past_key_values, use_cache=True)  # gradients on
    assert decoder.steps == 0 and decoder.prefills == 1                       # the prompt ran as a graph
    assert set(decoder.eager_calls) == {"not one sequence of token ids", "an attention mask with padding",
                                        "gradients enabled"}


def test_a_prompt_runs_in_chunks_and_equals_the_eager_path(tmp_path, monkeypatch):
    """A prompt longer than a chunk (4 tokens here) runs as graphs of 4, 4 and 2 tokens, each
    keeping one row of logits (the last one's: the logits asked for): its logits and KV rows equal the eager path's; the
    routing is counted once per layer for the whole prompt, as eagerly. All the logits of a
    prompt over a chunk are the eager path's to give."""
    monkeypatch.setattr(ggmlgraph, "_CHUNK", 4)
    model = _load(tmp_path, "qwen3_moe", "F32", "F32")
    decoder, prompt = model._expertcache_graph, torch.arange(100, 110).view(1, 10)
    outs, counts = {}, {}
    for enabled in (False, True):
        decoder.enabled = enabled
        model.expertcache.reset_stats()
        with torch.no_grad():
            outs[enabled] = model(prompt, use_cache=True, logits_to_keep=1)
        counts[enabled] = model.expertcache.stats().sums(0)
    assert decoder.prefills == 1 and {k[:2] for k in decoder.graphs} == {(4, 1), (2, 1)}  # (tokens, logits kept)
    assert outs[True].logits.shape == (1, 1, outs[False].logits.shape[-1])
    assert _rel(outs[True].logits, outs[False].logits) < FLOAT_TOL
    for mine, ref in zip(outs[True].past_key_values.layers, outs[False].past_key_values.layers):
        assert mine.keys.shape == ref.keys.shape and mine.keys.shape[2] == 10 and _rel(mine.keys, ref.keys) < FLOAT_TOL
    assert counts[True]["accesses"] == counts[False]["accesses"] > 0
    with torch.no_grad():
        model(prompt, use_cache=True)                                       # every position's logits
    assert decoder.eager_calls["logits of more than the last chunk of a prompt over 4 tokens"] == 1
    with torch.no_grad():
        tokens = {e: (setattr(decoder, "enabled", e), model.generate(prompt, max_new_tokens=6, do_sample=False))[1]
                  for e in (False, True)}
    assert torch.equal(tokens[True], tokens[False])


def test_summary_says_why_the_graph_is_off(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0")
    off = expertcache.offload(path, device="cpu", baseline="resident", cpu_graph="off").expertcache.summary()
    assert (off["cpu_graph"], off["cpu_graph_reason"]) == ("off", "cpu_graph='off' asked for")
    slots = expertcache.offload(path, device="cpu", slots=8).expertcache.summary()
    assert slots["cpu_graph"] == "off" and "slots cache experts" in slots["cpu_graph_reason"]
    torch_run = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="torch")
    assert torch_run.expertcache.stats().pool["cpu_graph"] == "off"   # no ggml kernels: never attached
    cpu = expertcache.offload(path, device="cpu", baseline="cpu").expertcache.summary()
    assert cpu["cpu_graph"] == "on"  # every expert computed from the host's bytes, as resident
    tiered = expertcache.offload(path, device="cpu", baseline="resident", host_memory="tiered",
                                 host_budget=0.5).expertcache.summary()
    assert tiered["cpu_graph"] == "on" and "experts from the RAM tier's rows" in tiered["cpu_graph_reason"]
    tiered_cpu = expertcache.offload(path, device="cpu", baseline="cpu", host_memory="tiered",
                                     host_budget=0.5).expertcache.summary()     # runtime/ggmltier.py
    assert tiered_cpu["cpu_graph"] == "off" and "tiered' with slots or baseline 'cpu'" in tiered_cpu["cpu_graph_reason"]
    with pytest.raises(ValueError, match="cpu_graph"):
        expertcache.offload(path, device="cpu", baseline="resident", cpu_graph="on")


# GPT-OSS: 4 layers, sliding (window 4) and full in turn; a 9-token prompt, then 16 steps
OSS_PROMPT, OSS_STEPS, OSS_WINDOW = [[100 + i for i in range(9)]], 16, 4
OSS_FORCED = torch.randint(0, 256, (OSS_STEPS,), generator=torch.Generator().manual_seed(1)).tolist()


def _gpt_oss(tmp_path, experts="F32", dense="F32"):
    path = write_gguf(tmp_path / f"gpt_oss_{experts}_{dense}.gguf", "gpt_oss", experts, dense_type=dense,
                      layers=4, sliding_window=OSS_WINDOW)
    return expertcache.offload(path, device="cpu", baseline="resident")


@pytest.mark.parametrize("experts,dense", [("F32", "F32"), ("MXFP4", "Q8_0")])
def test_gpt_oss_decodes_through_the_graph(tmp_path, experts, dense):
    """Sinks, sliding and full layers (the prompt and the decode run past the window), YaRN
    RoPE with its attention factor, q/k/v/o biases, the router's bias and softmax over the top-k
    logits, expert biases and the clamped SwiGLU, against the per-layer path: greedy tokens
    equal, and logits of a teacher-forced run over varied tokens (the greedy run repeats one)
    within FLOAT_TOL (float32, measured 7e-7) or, quantized, each step within STEP_TOL with
    the same top-1 wherever the margin allows (the module docstring says why)."""
    model = _gpt_oss(tmp_path, experts, dense)
    summary = model.expertcache.summary()
    assert summary["cpu_graph"] == "on", summary["cpu_graph_reason"]
    assert model.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    decoder = model._expertcache_graph
    decoder.enabled = False
    eager_tokens, _, _, _ = _decode(model, OSS_PROMPT, OSS_STEPS)
    _, eager_logits, _, _ = _decode(model, OSS_PROMPT, OSS_STEPS, forced=OSS_FORCED)
    decoder.enabled = True
    tokens, _, past, _ = _decode(model, OSS_PROMPT, OSS_STEPS)
    _, logits, _, _ = _decode(model, OSS_PROMPT, OSS_STEPS, forced=OSS_FORCED)
    assert decoder.steps == 2 * OSS_STEPS and decoder.prefills == 2 and set(decoder.eager_calls) == {"disabled"}
    assert tokens == eager_tokens
    if experts == "F32":
        assert _rel(logits, eager_logits) < FLOAT_TOL
    for step, (mine, ref) in enumerate(zip(logits, eager_logits)):
        assert _rel(mine, ref) < STEP_TOL, step
        top = ref.topk(2).values
        if top[0] - top[1] > (mine - ref).abs().max():
            assert mine.argmax() == ref.argmax(), step
    # a sliding layer's cache reads the last window - 1 rows, as transformers keeps them
    n = len(OSS_PROMPT[0]) + OSS_STEPS
    assert past.get_seq_length() == past.layers[0].cumulative_length == n
    assert past.layers[0].keys.shape[2] == OSS_WINDOW - 1 and past.layers[1].keys.shape[2] == n


def test_gpt_oss_hands_its_sliding_cache_over_both_ways(tmp_path, monkeypatch):
    """A prompt in chunks of 4 (the window crossed within and between chunks), decode steps
    through the graph, then eager ones (reading the graph's rows: a sliding layer the last
    window - 1), then the graph again (handed the eager path's window - 1 rows: the rows
    before are masked), the KV buffers grown from 2 rows, a deep copy decoding on: the
    tokens and logits equal the per-layer path's throughout."""
    import copy

    monkeypatch.setattr(ggmlgraph, "_MIN_CAPACITY", 2)
    monkeypatch.setattr(ggmlgraph, "_CHUNK", 4)
    model = _gpt_oss(tmp_path)
    decoder = model._expertcache_graph

    def run(graph: bool):
        decoder.enabled = graph
        with torch.no_grad():
            out = model(torch.tensor(OSS_PROMPT), use_cache=True, logits_to_keep=1)
        tokens, logits, past, tok = _decode(model, None, 4, out.past_key_values, out.logits[:, -1:].argmax(-1))
        twin, twin_tok = copy.deepcopy(past), tok          # while the graph's buffers hold the rows
        assert type(twin.layers[0]).__name__ == "DynamicSlidingWindowLayer"
        assert twin.layers[0].cumulative_length == len(OSS_PROMPT[0]) + 4
        decoder.enabled = False
        more, more_logits, past, tok = _decode(model, None, 3, past, tok)
        decoder.enabled = graph
        last, last_logits, past, _ = _decode(model, None, 5, past, tok)
        again, again_logits, _, _ = _decode(model, None, 5, twin, twin_tok)
        return tokens + more + last + again, torch.cat([out.logits[0], logits, more_logits, last_logits, again_logits])

    eager_tokens, eager_logits = run(False)
    tokens, logits = run(True)
    assert decoder.prefills == 1 and decoder.steps == 14 and decoder.capacity >= 21
    assert tokens == eager_tokens and _rel(logits, eager_logits) < FLOAT_TOL
    with torch.no_grad():
        generated = {e: (setattr(decoder, "enabled", e),
                         model.generate(torch.tensor(OSS_PROMPT), max_new_tokens=6, do_sample=False))[1]
                     for e in (False, True)}
    assert torch.equal(generated[True], generated[False]) and decoder.steps == 19


def test_gpt_oss_sliding_layers_keep_a_ring(tmp_path, monkeypatch):
    """A sliding layer holds window + chunk rows however long the decode (position p in row
    p mod R), while full layers grow; at every step the caller's sliding cache reads the last
    window - 1 rows in order (a copy where they wrap the ring), equal to the eager path's."""
    monkeypatch.setattr(ggmlgraph, "_MIN_CAPACITY", 2)
    monkeypatch.setattr(ggmlgraph, "_CHUNK", 4)
    model = _gpt_oss(tmp_path)
    decoder = model._expertcache_graph
    caches = {}
    for graph in (False, True):
        decoder.enabled = graph
        seen = []
        with torch.no_grad():
            out = model(torch.tensor(OSS_PROMPT), use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(12):                       # positions 9 .. 20: the ring of 8 wraps
                out = model(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                seen.append((past.layers[0].keys.clone(), past.layers[0].values.clone(), past.layers[1].keys.clone()))
        caches[graph] = seen
    ring = OSS_WINDOW + 4
    assert decoder.kv[0][0].shape[0] == ring and decoder.capacity >= len(OSS_PROMPT[0]) + 12 > ring
    assert decoder.kv[1][0].shape[0] == decoder.capacity
    for (k, v, full), (k_ref, v_ref, full_ref) in zip(caches[True], caches[False]):
        assert k.shape == k_ref.shape == (1, model.config.num_key_value_heads, OSS_WINDOW - 1, k.shape[-1])
        assert _rel(k, k_ref) < FLOAT_TOL and _rel(v, v_ref) < FLOAT_TOL and _rel(full, full_ref) < FLOAT_TOL


def test_deepseek_decodes_through_the_graph(tmp_path, monkeypatch):
    """DeepSeek-V3 (arch deepseek2) takes the graph: MLA in llama.cpp's absorbed form over a cache
    of transformers' latent rows, the group-limited sigmoid routing, the dense first layer. The
    KV cache moves between the graph and the eager path both ways (eager steps read the graph's
    rows, then the graph the eager rows), grows from 2 rows, and another cache decodes in
    between: tokens equal the all-eager run's and logits within FLOAT_TOL throughout."""
    monkeypatch.setattr(ggmlgraph, "_MIN_CAPACITY", 2)
    model = _load(tmp_path, "deepseek_v3", "F32", "F32")
    summary = model.expertcache.summary()
    assert summary["cpu_graph"] == "on"
    assert summary["cpu_graph_reason"].startswith("one ggml graph a forward (deepseek_v3")
    decoder, cfg = model._expertcache_graph, model.config
    assert "mlp" in decoder.spec.layers[0] and cfg.n_group > 1 and cfg.topk_group < cfg.n_group
    _sharpen_attention(model, SHARPEN)

    def run(graph: bool):
        decoder.enabled = graph
        a_tok, a_log, past, tok = _decode(model, PROMPT, 4)
        decoder.enabled = False                                          # eager steps on the graph's rows
        b_tok, b_log, past, tok = _decode(model, None, 3, past, tok)
        decoder.enabled = graph                                          # the graph on the eager rows
        c_tok, c_log, _, _ = _decode(model, [[50, 51]], 5)               # another cache in between
        d_tok, d_log, past, _ = _decode(model, None, 6, past, tok)
        return a_tok + b_tok + c_tok + d_tok, torch.cat([a_log, b_log, c_log, d_log]), past

    eager_tokens, eager_logits, _ = run(False)
    tokens, logits, past = run(True)
    assert decoder.steps == 15 and decoder.capacity >= 16
    assert tokens == eager_tokens
    assert _rel(logits, eager_logits) < FLOAT_TOL
    # the caller's cache holds transformers' latent rows: keys [1, 1, n, latent], values [1, 1, n, rope]
    n = past.get_seq_length()
    assert n == len(PROMPT[0]) + 13
    assert past.layers[1].keys.shape == (1, 1, n, cfg.kv_lora_rank)
    assert past.layers[1].values.shape == (1, 1, n, cfg.qk_rope_head_dim)


# q and k_pe scaled in the loaded model (both paths read the same float32 weights): the fixture's
# initial weights (std 0.02) leave every attention score near 0, the softmax near uniform, and
# an error in q.k unseen
SHARPEN = 6.0


def _sharpen_attention(model, factor: float) -> None:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(factor)
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(factor)


def test_deepseek_without_a_q_lora_rank(tmp_path, monkeypatch):
    """q by one q_proj (``q_lora_rank`` None: no q_a / q_b): greedy tokens and logits of the
    graph equal the per-layer path's."""
    import gguf_models

    tiny = gguf_models.tiny_config

    def config(*args, **kwargs):
        cfg = tiny(*args, **kwargs)
        cfg.q_lora_rank = None
        return cfg
    monkeypatch.setattr(gguf_models, "tiny_config", config)
    model = _load(tmp_path, "deepseek_v3", "F32", "F32")
    assert model.config.q_lora_rank is None and "q" in model._expertcache_graph.spec.layers[1]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARPEN)
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(SHARPEN)
    decoder = model._expertcache_graph
    decoder.enabled = False
    eager_tokens, eager_logits, _, _ = _decode(model, PROMPT, 8)
    decoder.enabled = True
    tokens, logits, _, _ = _decode(model, PROMPT, 8)
    assert decoder.steps == 8 and tokens == eager_tokens and _rel(logits, eager_logits) < FLOAT_TOL


def test_deepseek_graph_routing_equals_the_eager_router(tmp_path):
    """The graph's choice of experts (sigmoid, selection bias, groups by their top-2 sum, top-k
    among the kept groups) is transformers' router's, token for token, over a prompt run as one
    graph: the cache's counters and the graph's ids against the router's own output."""
    model = _load(tmp_path, "deepseek_v3", "F32", "F32")
    decoder = model._expertcache_graph
    prompt = torch.arange(20, 60).view(1, 40)
    picks, ungrouped = [], []

    def hook(router, args, out):
        picks.append(out[2].sort(-1).values)                                     # [T, K]
        choice = out[0].sigmoid() + router.e_score_correction_bias              # without the groups
        ungrouped.append(choice.topk(router.top_k, -1).indices.sort(-1).values)

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers[1:]]
    decoder.enabled = False
    with torch.no_grad():
        model(prompt, use_cache=True)
    for hook in hooks:
        hook.remove()
    decoder.enabled = True
    with torch.no_grad():
        model(prompt, use_cache=True)
    mine = [torch.from_numpy(ids.copy()).long().sort(-1).values for ids in decoder.graphs[(40, 40, 256)].routed()]
    assert len(mine) == len(picks) == 2
    for ids, ref in zip(mine, picks):
        assert torch.equal(ids, ref)
    # the groups decide: without them some tokens would have gone elsewhere
    assert any(not torch.equal(ref, plain) for ref, plain in zip(picks, ungrouped))


def test_the_graph_checks_what_it_reads_of_mixtral_and_olmoe(tmp_path):
    """Mixtral's router always renormalises its top-k weights (no switch), OLMoE's as
    ``norm_topk_prob`` says (False from llama.cpp's files); OLMoE's q/k norms span all heads.
    A Mixtral config with a sliding window and no layer types stays on the per-layer path."""
    mixtral = _load(tmp_path, "mixtral", "Q8_0", "F32")
    olmoe = _load(tmp_path, "olmoe", "Q8_0", "F32")
    assert [L["moe"]["norm"] for L in mixtral._expertcache_graph.spec.layers] == [True, True]
    layer = olmoe._expertcache_graph.spec.layers[0]
    assert layer["moe"]["norm"] is False and layer["q_norm"][2] and layer["k_norm"][2]
    mixtral.config.sliding_window = 8
    assert ggmlgraph.support(mixtral, mixtral.expertcache) == "a sliding window (8) without layer_types"


def test_gpt_oss_from_an_hf_mxfp4_checkpoint_says_why(tmp_path):
    """An HF MXFP4 checkpoint keeps gate and up rows alternating in one tensor (the graph reads a
    GGUF's two): the per-layer path, and the summary names the reason."""
    from test_hf_quant import write_gpt_oss_mxfp4

    summary = expertcache.offload(write_gpt_oss_mxfp4(tmp_path), device="cpu",
                                  baseline="resident").expertcache.summary()
    assert summary["cpu_graph"] == "off" and "alternate in one tensor" in summary["cpu_graph_reason"]


def test_the_cli_flag_reaches_the_config():
    import argparse

    from expertcache.cli.options import add_cache_options, cache_config

    p = argparse.ArgumentParser()
    add_cache_options(p)
    assert cache_config(p.parse_args(["--baseline", "resident"])).cpu_graph == "auto"
    assert cache_config(p.parse_args(["--baseline", "resident", "--cpu-graph", "off"])).cpu_graph == "off"


# llama.cpp on the Mixtral (arch llama, q/k permuted) and OLMoE fixtures: measured 1.1e-6 and 5.8e-7
FAMILY_LLAMA_TOL = {"dense_mixtral_Q4_K_F32": 1e-5, "dense_olmoe_Q8_0_F32": 1e-5, "dense_deepseek_v3_Q8_0_F32": 1e-5}


def _forced_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """The last position's logits [T, vocab] of a teacher-forced run over ``tokens`` [T]: the
    first token as a prompt, then one decode step a token."""
    rows = []
    with torch.no_grad():
        out = model(tokens[:1].unsqueeze(0), use_cache=True)
        rows.append(out.logits[0, -1])
        for t in tokens[1:]:
            out = model(t.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


@pytest.mark.parametrize("family,experts,dense", [("qwen3_moe", "Q4_K", "Q8_0"), ("qwen2_moe", "Q8_0", "Q4_0"),
                                                  ("mixtral", "Q4_K", "F32"), ("olmoe", "Q8_0", "F32"),
                                                  ("deepseek_v3", "Q8_0", "F32")])
def test_graph_decode_against_llamacpps_logits(tmp_path, family, experts, dense):
    """llama.cpp's logits for the same file and tokens (``tests/data/llamacpp_logits.npz``, made by
    ``tests/make_llamacpp_reference.py``), every position after the first decoded by the graph,
    teacher-forced: within ``test_ggml_dense.LLAMA_TOL`` (measured: 0 for the Q4_K / Q8_0 fixture,
    as the per-layer path; 1.37% for the Q4_0 one, as the per-layer path)."""
    import hashlib

    import numpy as np
    from make_llamacpp_reference import dense_key
    from test_ggml_dense import LLAMA_TOL, REFERENCE

    ref, key = np.load(REFERENCE), dense_key(family, experts, dense)
    path = write_gguf(tmp_path / "m.gguf", family, experts, dense_type=dense)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(ref[f"{key}_sha256"])
    llama, tokens = torch.from_numpy(ref[f"{key}_logits"]), torch.from_numpy(ref["tokens"])
    model = expertcache.offload(path, device="cpu", baseline="resident")
    logits = _forced_logits(model, tokens)                                      # [T, vocab]
    assert model._expertcache_graph.steps == len(tokens) - 1
    assert _rel(logits, llama) < (LLAMA_TOL | FAMILY_LLAMA_TOL)[key]


def test_deepseek_per_layer_path_against_llamacpps_logits(tmp_path):
    """DeepSeek-V3 (arch deepseek2: MLA with kv_b_proj split into k_b / v_b, YaRN, sigmoid routing
    over expert groups with a selection bias, a dense first layer, a shared expert): llama.cpp's
    logits for the fixture equal the loaded model's on the per-layer path with ggml's kernels,
    teacher-forced (measured 3.0e-7 relative L2; the torch kernels differ by ggml's 8-bit
    activations, 0.96%): the fixture is laid out as llama.cpp reads it, and the loader reads it so."""
    import hashlib

    import numpy as np
    from make_llamacpp_reference import dense_key
    from test_ggml_dense import REFERENCE

    ref, key = np.load(REFERENCE), dense_key("deepseek_v3", "Q8_0", "F32")
    path = write_gguf(tmp_path / "m.gguf", "deepseek_v3", "Q8_0")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == str(ref[f"{key}_sha256"])
    llama, tokens = torch.from_numpy(ref[f"{key}_logits"]), torch.from_numpy(ref["tokens"])
    model = expertcache.offload(path, device="cpu", baseline="resident", cpu_kernel="ggml", cpu_graph="off")
    assert _rel(_forced_logits(model, tokens), llama) < 1e-5                   # [T, vocab] each


def test_a_deep_copy_of_the_cache_holds_its_own_rows(tmp_path):
    import copy

    model = _load(tmp_path, "qwen3_moe", "F32", "F32")
    _, _, past, tok = _decode(model, PROMPT, 3)
    twin = copy.deepcopy(past)
    assert all(type(layer).__name__ == "DynamicLayer" for layer in twin.layers)
    assert torch.equal(twin.layers[1].values, past.layers[1].values)
    assert twin.layers[1].values.data_ptr() != past.layers[1].values.data_ptr()
    more, logits, _, _ = _decode(model, None, 3, twin, tok)     # the copy decodes on (handed over)
    again, logits_again, _, _ = _decode(model, None, 3, past, tok)
    assert more == again and _rel(logits, logits_again) < FLOAT_TOL


def test_recording_a_trace_sees_every_decode_step(tmp_path):
    """A trace is read from the routers' forward hooks, which the graph does not run: recording
    turns it off for the run and back on after."""
    from expertcache.integrations.record import record

    model = _load(tmp_path, "qwen3_moe", "Q8_0", "F32", baseline="cpu")
    trace = record(model, torch.tensor(PROMPT), 4)
    assert trace.experts.shape[1] == len(PROMPT[0]) + 3       # the prompt and the decode steps
    assert model._expertcache_graph.enabled and model._expertcache_graph.steps == 0


def test_transformers_generate_decodes_through_the_graph(tmp_path):
    model = _load(tmp_path, "qwen3_moe", "F32", "F32")
    decoder, outs = model._expertcache_graph, {}
    for enabled in (False, True):
        decoder.enabled = enabled
        with torch.no_grad():
            outs[enabled] = model.generate(torch.tensor(PROMPT), max_new_tokens=8, do_sample=False)
    assert decoder.steps == 7 and torch.equal(outs[False], outs[True])


def test_a_reloaded_library_is_declared_again(tmp_path):
    """A graph built after ggml's libraries were loaded anew (``_load.cache_clear()``, as a test of
    the fallback does) declares its functions on the new handles: undeclared, a pointer came back
    as an int and the next graph crashed the process (seen in the full suite)."""
    from expertcache.quant import ggmlgraph as graph_mod

    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0")
    ids = torch.tensor([[3, 5, 7]])
    first = expertcache.offload(path, device="cpu", baseline="resident")
    want = first.generate(ids, max_new_tokens=3, do_sample=False)
    ggml._load.cache_clear()
    assert ggml.available()[0]
    assert graph_mod._declared_for is not ggml._LIBS[0]          # new handles, not yet declared
    again = expertcache.offload(path, device="cpu", baseline="resident")
    assert again.expertcache.summary()["cpu_graph"] == "on"
    assert torch.equal(again.generate(ids, max_new_tokens=3, do_sample=False), want)
    assert graph_mod._declared_for is ggml._LIBS[0]
