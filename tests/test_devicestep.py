"""planner='device': the step on the device (runtime/devicestep.py), the policy a forward behind
(lagged.py), its replay (sim --lag), and the compiled MoE block."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_moe import FAMILIES, tiny_model  # noqa: E402

from expertcache.config import CacheConfig  # noqa: E402
from expertcache.integrations.record import record  # noqa: E402
from expertcache.integrations.transformers import offload  # noqa: E402
from expertcache.runtime.devicestep import DeviceStep, assign_staging  # noqa: E402
from expertcache.sim.lag import lag_replay  # noqa: E402
from expertcache.sim.replay import replay  # noqa: E402

FIELDS = ("accesses", "hits", "misses", "loads", "evictions", "bypasses")


@pytest.fixture(scope="module")
def reference():
    return tiny_model("qwen3_moe")  # 2 MoE layers x 8 experts, top-2: 16 experts in all


def _ids(batch: int, length: int = 10, seed: int = 3):
    return torch.randint(2, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, mask=None, n=6):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


# -- the step itself ---------------------------------------------------------------------------
def test_assign_staging_by_hand():
    row = torch.tensor([-1, 0, -1, 2, -1, -1], dtype=torch.int32)   # experts 1 and 3 resident
    ids = torch.tensor([[4, 1], [2, 4], [3, 0]])
    rows, staged = assign_staging(row, ids, 5, 4, torch.arange(6))
    # misses 0, 2, 4 take staging rows 5, 6, 7 in expert order; row 8 holds none (sentinel 6)
    assert rows.tolist() == [[7, 0], [6, 7], [2, 5]]
    assert staged.tolist() == [0, 2, 4, 6]


def _toy(slots=3, staging=4, blocks=1):
    torch.manual_seed(0)
    L, E, H = 2, 8, 5
    hosts = [{"w": torch.randn(E, H, H), "b": torch.randn(E, H)} for _ in range(L)]
    pool = {"w": torch.zeros(slots + staging, H, H), "b": torch.zeros(slots + staging, H)}
    step = DeviceStep(pool, hosts, slots, top_k=2, max_tokens=8, blocks=blocks)
    return step, hosts, pool


def _kernel(pool):
    return lambda x, w, ids: torch.einsum("th,tkoh,tk->to", x, pool["w"][ids.long()], w) + \
        (pool["b"][ids.long()] * w[..., None]).sum(1)


def test_step_is_exact_with_any_slot_map():
    step, hosts, pool = _toy()
    step.apply([(0, 1, 0, -1), (0, 5, 2, -1), (1, 7, 1, -1)])   # three residents, from the host
    x, w = torch.randn(3, 5), torch.rand(3, 2)
    for layer, ids in [(0, [[1, 3], [7, 5], [1, 5]]), (1, [[7, 0], [2, 3], [0, 1]])]:
        ids = torch.tensor(ids)
        out = step.run(layer, x, w, ids, _kernel(pool))
        plain = {k: v for k, v in hosts[layer].items()}
        assert torch.allclose(out, _kernel(plain)(x, w, ids), atol=1e-6)
        assert torch.equal(step.routing(layer, 3), ids.int())
    assert step.fits(2) and not step.fits(3)  # 3 tokens x top-2 > 4 staging rows


def test_staging_blocks_per_layer():
    step, hosts, pool = _toy(slots=2, staging=4, blocks=2)
    x, w = torch.randn(1, 5), torch.rand(1, 2)
    step.run(0, x, w, torch.tensor([[3, 4]]), _kernel(pool))
    step.run(1, x, w, torch.tensor([[6, 2]]), _kernel(pool))
    # layer 0 staged into rows 2, 3 and layer 1 into rows 4, 5: both survive the forward
    assert torch.equal(pool["w"][2], hosts[0]["w"][3]) and torch.equal(pool["w"][3], hosts[0]["w"][4])
    assert torch.equal(pool["w"][4], hosts[1]["w"][2]) and torch.equal(pool["w"][5], hosts[1]["w"][6])


def test_fixed_update_list_equals_host_updates():
    a, hosts, pool_a = _toy()
    b, _, pool_b = _toy()
    for step, pool in ((a, pool_a), (b, pool_b)):
        step.run(0, torch.randn(1, 5), torch.rand(1, 2), torch.tensor([[6, 2]]), _kernel(pool))
    updates = [(0, 6, 1, 1), (1, 4, 0, -1), (0, 2, 2, 0), (1, 3, -1, -1)]
    a.apply(updates)
    buffers = b.fixed_buffers(6)
    b.fill_fixed(buffers, updates)
    b.apply_fixed(buffers)
    assert torch.equal(a.slot_map, b.slot_map)
    for kind in pool_a:
        assert torch.equal(pool_a[kind][:3], pool_b[kind][:3])
    assert torch.equal(pool_a["w"][1], hosts[0]["w"][6]) and torch.equal(pool_a["w"][0], hosts[1]["w"][4])
    with pytest.raises(ValueError, match="exceed"):
        b.fill_fixed(b.fixed_buffers(2), updates)


# -- the runtime with planner='device' -------------------------------------------------------------
@pytest.mark.parametrize("slots", [16, 8, 4], ids=["100%", "50%", "25%"])
@pytest.mark.parametrize("batch", [1, 4])
def test_device_planner_equals_plain_transformers(reference, slots, batch):
    ids = _ids(batch)
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding, as batched generation pads
        mask[1, :3] = 0
        mask[3, :1] = 0
        ids = ids.masked_fill(mask == 0, 0)
    model = offload(copy.deepcopy(reference), slots=slots, planner="device", staging=batch * 2)
    tokens, logits = _generate(model, ids, mask)
    ref_tokens, ref_logits = _generate(reference, ids, mask)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max().item() <= 1e-5
    planner = model.expertcache.planner
    assert planner.device_forwards == 5 and planner.host_forwards == 1  # decode on the device
    total = model.expertcache.stats().total("decode")
    assert total.accesses == total.hits + total.misses > 0
    if slots < 16:
        assert total.misses > 0


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3_moe"])
def test_device_planner_on_every_family(family):
    """Biases, [in, out] weights (GPT-OSS), shared experts, custom gates: as eager, at 50% slots."""
    reference = tiny_model(family)
    model = offload(copy.deepcopy(reference), slots=8, planner="device")
    tokens, logits = _generate(model, _ids(1), n=4)
    ref_tokens, ref_logits = _generate(reference, _ids(1), n=4)
    assert torch.equal(tokens, ref_tokens) and (logits - ref_logits).abs().max().item() <= 1e-5
    assert model.expertcache.planner.device_forwards == 3


@pytest.mark.parametrize("kwargs", [
    dict(slots=4),
    dict(slots=6, lag=2),
    dict(slots=4, partition="per-layer", eviction="fifo"),
    dict(slots=5, eviction="slru", admission="second-hit"),
    dict(slots=4, eviction="lfu", admission="window", lag=3),
    dict(slots=4, staging=4, staging_blocks=2),
], ids=["default", "lag2", "fifo-per-layer", "slru-second-hit", "lfu-window-lag3", "blocks2"])
def test_live_counts_equal_sim_lag_replay(reference, kwargs):
    live = offload(copy.deepcopy(reference), planner="device", **kwargs)
    trace = record(live, _ids(1, seed=11), 9)
    policy = kwargs.get("eviction", "default") + (f"+{kwargs['admission']}" if "admission" in kwargs else "")
    # the device planner's default: a block of top-k (2) rows per layer; else staging // blocks
    blocks = kwargs.get("staging_blocks", 2)
    width = kwargs["staging"] // blocks if "staging_blocks" in kwargs else 2
    replayed = lag_replay(trace, policy, kwargs["slots"], kwargs.get("partition", "global"), kwargs.get("lag", 1),
                          staging=width, blocks=blocks)
    observed = live.expertcache.stats()
    for phase in ("prefill", "decode"):
        for layer in range(2):
            assert observed.layer(layer, phase) == replayed.stats.layer(layer, phase), (phase, layer)
    planner = live.expertcache.planner
    assert observed.total("decode").misses > 0 and planner.device_forwards == 8
    # bytes: staged misses and loads without a staging row, as the replay counts them
    copied = replayed.staged + replayed.host_loads
    assert observed.h2d_bytes("decode") == copied * live.expertcache.expert_bytes
    pool = observed.pool
    assert pool["planner"] == "device" and pool["lag"] == kwargs.get("lag", 1) and pool["device_forwards"] == 8
    assert pool["pending_forwards"] == kwargs.get("lag", 1)  # observed, not yet decided
    # a block per layer (the default): admitted misses load from their staging row
    assert planner.step.blocks == 2 and planner.lagged.staging_loads > 0


def test_lag_zero_is_the_plain_replay(reference):
    trace = record(copy.deepcopy(reference), _ids(1), 9)
    plain, lagged = replay(trace, "lru", 5), lag_replay(trace, "lru", 5, lag=0)
    assert plain.stats.total() == lagged.stats.total() and lagged.host_copies == plain.misses


def test_device_planner_settings(reference):
    with pytest.raises(ValueError, match="unknown planner 'gpu'"):
        CacheConfig(slots=4, planner="gpu")
    with pytest.raises(ValueError, match="lag must be"):
        CacheConfig(slots=4, planner="device", lag=0)
    with pytest.raises(ValueError, match="staging_blocks=3 exceeds staging=2"):
        CacheConfig(slots=4, planner="device", staging=2, staging_blocks=3)
    model = offload(copy.deepcopy(reference), slots=4, planner="device", miss="cpu")
    assert model.expertcache.planner is None and "miss path 'cpu'" in model.expertcache.planner_reason
    assert model.expertcache.summary()["planner"] == "host"
    assert offload(copy.deepcopy(reference), slots=4, planner="device").expertcache.summary()["planner"] == "device"


def test_compiled_moe_block_equals_eager(reference):
    """The MoE block with the device step compiles whole (fullgraph: no break), holds no
    expertcache op, and computes what eager does."""
    model = offload(copy.deepcopy(reference), slots=4, planner="device")
    _generate(model, _ids(1), n=3)  # the map now holds some experts, some not
    cache = model.expertcache
    cache.set_phase(1, 1)  # a decode forward of one token: the device path
    assert cache.planner.active
    block = model.model.layers[1].mlp
    ops = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True, backend=backend)(x)
    assert torch.allclose(eager, compiled, atol=1e-6)
    assert ops and not any("expertcache" in op for op in ops)
    assert any("scatter_reduce" in op or "cumsum" in op for op in ops)  # the step is in the graph


@pytest.mark.gpu
def test_cuda_view_and_masked_gather():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from expertcache.runtime.devicestep import cuda_view, gather_rows
    host = torch.randn(6, 3, 4, dtype=torch.bfloat16).pin_memory()
    view = cuda_view(host, torch.device("cuda"))
    assert view.is_cuda and torch.equal(view.cpu(), host)
    out = torch.zeros(4, 3, 4, dtype=torch.bfloat16, device="cuda")
    gather_rows(view, torch.tensor([5, 0, 6, 2], device="cuda"), out)
    assert torch.equal(out[0].cpu(), host[5]) and torch.equal(out[1].cpu(), host[0])
    assert torch.equal(out[3].cpu(), host[2])


@pytest.mark.gpu
def test_device_planner_on_cuda_equals_plain(reference):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = offload(copy.deepcopy(reference), slots=4, planner="device", device="cuda")
    plain = copy.deepcopy(reference).to("cuda")
    ids = _ids(1).to("cuda")
    tokens, logits = _generate(model, ids)
    ref_tokens, ref_logits = _generate(plain, ids)
    assert torch.equal(tokens, ref_tokens) and (logits - ref_logits).abs().max().item() <= 1e-4


@pytest.mark.gpu
def test_cuda_step_makes_no_sync():
    """A device step (lookup, staging from pinned memory, kernel, routing record) with
    synchronising CUDA calls made errors."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    L, E, H, S, R = 2, 8, 16, 3, 4
    hosts = [{"w": torch.randn(E, H, H).pin_memory()} for _ in range(L)]
    pool = {"w": torch.zeros(S + R, H, H, device="cuda")}
    step = DeviceStep(pool, hosts, S, top_k=2, max_tokens=8)
    step.apply([(0, 1, 0, -1), (1, 7, 2, -1)])
    kernel = lambda x, w, ids: torch.einsum("th,tkoh,tk->to", x, pool["w"][ids.long()], w)  # noqa: E731
    x, w = torch.randn(2, H, device="cuda"), torch.rand(2, 2, device="cuda")
    ids = torch.tensor([[1, 3], [6, 5]], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step.run(0, x, w, ids, kernel)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = torch.einsum("th,tkoh,tk->to", x.cpu(), hosts[0]["w"][ids.cpu()], w.cpu())
    assert torch.allclose(out.cpu(), ref, atol=1e-4)
    step.routed_event.synchronize() if step.routed_event is not None else torch.cuda.synchronize()
    assert torch.equal(step.routing(0, 2), ids.int().cpu())


def test_device_planner_bytes_match_the_host_planners(reference):
    """Issue 29, defect 2: with a staging block per layer (the device planner's default) an
    admitted miss crosses once, so decode H2D bytes are one copy per miss, as on the host
    planner; one shared block (``staging_blocks=1``) copies admitted misses a second time."""
    ids = _ids(1, seed=5)

    def decode(**kwargs):
        model = offload(copy.deepcopy(reference), slots=4, **kwargs)  # 25% of the 16 experts
        _generate(model, ids, n=12)
        stats, cache = model.expertcache.stats(), model.expertcache
        return stats.h2d_bytes("decode"), stats.total("decode").misses * cache.expert_bytes, cache

    host_bytes, host_missed, _ = decode(planner="host")
    assert host_bytes == host_missed > 0  # fetch: every miss is one copy (load or bypass)
    dev_bytes, dev_missed, cache = decode(planner="device")
    assert cache.planner.step.blocks == 2 and cache.pool.staging == 4  # a block of top-k rows per layer
    assert dev_missed > 0 and dev_bytes <= 1.05 * dev_missed
    assert cache.planner.lagged.host_loads == 0
    shared, shared_missed, cache = decode(planner="device", staging_blocks=1, staging=2)
    assert cache.planner.lagged.host_loads > 0 and shared > 1.05 * shared_missed  # the old default
