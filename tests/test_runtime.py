"""The runtime on the CPU: fixed-address slot pool, byte counters, baselines, sizing, errors."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_moe import tiny_model  # noqa: E402

import expertcache  # noqa: E402
from expertcache.integrations.transformers import offload  # noqa: E402


@pytest.fixture(scope="module")
def reference():
    return tiny_model("qwen3_moe")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(2, 96, (1, 12), generator=torch.Generator().manual_seed(3))


def _generate(model, ids, n=8):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def _assert_same(model, reference, ids):
    tokens, logits = _generate(model, ids)
    ref_tokens, ref_logits = _generate(reference, ids)
    assert (logits - ref_logits).abs().max().item() <= 1e-5
    assert torch.equal(tokens, ref_tokens)


def test_slot_pool_addresses_never_change(reference, ids):
    model = offload(copy.deepcopy(reference), slots=3)
    pool = model.expertcache.pool
    before = pool.data_ptrs()
    _generate(model, ids)
    _generate(model, ids[:, :5])
    assert model.expertcache.stats().total().evictions > 0  # slots were really rewritten
    assert pool.data_ptrs() == before
    # one tensor per weight kind, [cache slots + staging slots, ...]
    assert {k: t.shape[0] for k, t in pool.tensors.items()} == {"gate_up_proj": 5, "down_proj": 5}


def test_pool_holds_loaded_experts_bit_exactly(reference, ids):
    model = offload(copy.deepcopy(reference), slots=5)
    _generate(model, ids, n=3)
    cache = model.expertcache
    resident = cache.table.resident()
    assert resident
    for key, slot in resident.items():
        layer, expert = divmod(key, cache.num_experts)
        for kind, tensor in cache.pool.tensors.items():
            assert torch.equal(tensor[slot], cache.hosts[layer].tensors[kind][expert])


def test_h2d_bytes_count_loads_and_staging(reference, ids):
    model = offload(copy.deepcopy(reference), slots=3)
    _generate(model, ids)
    cache, stats = model.expertcache, model.expertcache.stats()
    total = stats.total()
    # fetch: every load and every bypass (through a staging slot) moves one expert
    assert stats.h2d_bytes() == (total.loads + total.bypasses) * cache.expert_bytes > 0
    assert stats.h2d_bytes("prefill") + stats.h2d_bytes("decode") == stats.h2d_bytes()
    assert sum(stats.h2d_bytes(layer=l) for l in range(cache.num_layers)) == stats.h2d_bytes()
    d = stats.to_dict()
    assert d["total"]["h2d_bytes"] == stats.h2d_bytes()
    assert d["layers"][1]["decode"]["h2d_bytes"] == stats.h2d_bytes("decode", 1)
    # phases: one prefill step per layer (the prompt), then one decode step per new token
    assert stats.layer(0, "prefill").accesses == len(set(_router_choices(reference, ids)[0]))
    model.expertcache.reset_stats()
    assert model.expertcache.stats().total().accesses == 0 and model.expertcache.stats().h2d_bytes() == 0


def _router_choices(model, ids):
    """Experts each layer's router picked for the prompt, via a forward hook on the plain model."""
    seen = []
    hooks = [m.register_forward_hook(lambda mod, a, out: seen.append(out[2].flatten().tolist()))
             for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("baseline", ["resident", "copy-every-pass", "cpu"])
def test_baselines_are_exact_configurations(reference, ids, baseline):
    model = offload(copy.deepcopy(reference), baseline=baseline)
    _assert_same(model, reference, ids)
    cache, total = model.expertcache, model.expertcache.stats().total()
    all_experts = cache.num_layers * cache.num_experts
    if baseline == "resident":
        assert total.hits == total.accesses and cache.stats().h2d_bytes() == 0
        assert cache.slot_bytes == all_experts * cache.expert_bytes
    elif baseline == "copy-every-pass":  # nothing kept: every used expert crosses again
        assert total.hits == 0 and total.loads == 0
        assert cache.stats().h2d_bytes() == total.bypasses * cache.expert_bytes
        assert cache.slot_bytes == cache.top_k * cache.expert_bytes  # staging only
    else:
        assert total.hits == 0 and cache.slot_bytes == 0 and cache.stats().h2d_bytes() == 0


def test_staging_streams_a_prompt_wider_than_the_pool(reference, ids):
    # one staging slot: the prompt's bypasses go through it in many rounds, and stay exact
    model = offload(copy.deepcopy(reference), baseline="copy-every-pass", staging=1)
    _assert_same(model, reference, ids)
    assert model.expertcache.stats().total("prefill").bypasses > 2


def test_gpu_memory_budget_sizes_the_pool(reference):
    expert_bytes = (48 * 32 + 32 * 24) * 4  # qwen3 tiny expert: gate_up [48, 32] + down [32, 24] fp32
    budget = 9 * expert_bytes + 100        # room for 9 experts: 2 staging + 7 cache slots
    cache = offload(copy.deepcopy(reference), gpu_memory=budget).expertcache
    assert cache.expert_bytes == expert_bytes
    assert (cache.pool.slots, cache.pool.staging) == (7, cache.top_k) == (7, 2)
    assert cache.slot_bytes == 9 * expert_bytes <= budget


def test_from_checkpoint_directory(reference, ids, tmp_path):
    reference.save_pretrained(tmp_path)
    model = offload(str(tmp_path), slots=3, dtype="float32")
    _assert_same(model, reference, ids)


# -- bad input: each a clear error naming the problem --------------------------------
def _error(match, **kwargs):
    return pytest.raises((ValueError, TypeError, FileNotFoundError), match=match)


def test_model_without_moe_layers():
    import transformers as tf

    dense = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               num_key_value_heads=2, intermediate_size=48, vocab_size=96))
    with _error("no MoE layers"):
        offload(dense, slots=4)


def test_capacity_below_top_k(reference, ids):
    model = copy.deepcopy(reference)
    with _error("capacity below top-k"):
        offload(model, slots=1)
    with torch.no_grad():  # a refused offload leaves the model whole
        assert torch.equal(model(ids).logits, reference(ids).logits)
    with _error("capacity below top-k"):
        offload(copy.deepcopy(reference), slots=2, partition="per-layer")
    with _error("capacity below top-k.*gpu_memory"):
        offload(copy.deepcopy(reference), gpu_memory="12KiB")


def test_budget_larger_than_free_memory(reference):
    with _error("free"):
        offload(copy.deepcopy(reference), gpu_memory="900TiB")


def test_missing_size_and_bad_settings(reference):
    with _error("needs a size"):
        offload(copy.deepcopy(reference))
    with _error("unknown miss"):
        offload(copy.deepcopy(reference), slots=4, miss="disk")
    with _error("offline oracle"):
        offload(copy.deepcopy(reference), slots=4, eviction="belady")
    with _error("counts file not found: x.gguf"):  # imatrix placement: tests/test_imatrix_runtime.py
        offload(copy.deepcopy(reference), config=expertcache.config.CacheConfig(slots=4, imatrix="x.gguf"))
    with _error("8GiB"):
        offload(copy.deepcopy(reference), gpu_memory="eight gigs")
    dispatched = copy.deepcopy(reference)
    dispatched.hf_device_map = {"model": "cpu", "lm_head": "disk"}
    with _error("device_map"):
        offload(dispatched, slots=4)
    model = offload(copy.deepcopy(reference), slots=4)
    with _error("already offloaded"):
        offload(model, slots=4)
    with _error("transformers model or a checkpoint"):
        offload(42, slots=4)
    intact = copy.deepcopy(reference)
    with _error("host_memory='mmap' reads experts from a GGUF file"):  # float experts live in RAM
        offload(intact, slots=4, host_memory="mmap")
    from expertcache.loaders.common import find_experts
    assert find_experts(intact)[0][1].gate_up_proj.shape[0] == 8  # refused before the experts left


def test_missing_or_incomplete_checkpoint(reference, tmp_path):
    with _error("not found"):
        offload(str(tmp_path / "nowhere"), slots=4)
    (tmp_path / "a").mkdir()
    with _error("no config.json"):
        offload(tmp_path / "a", slots=4)
    reference.save_pretrained(tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").unlink()
    with _error("no weights"):
        offload(tmp_path / "b", slots=4)
    (tmp_path / "b" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00002.safetensors"}}))
    with _error("missing: model-00001-of-00002"):
        offload(tmp_path / "b", slots=4)


def test_unsupported_expert_layouts(reference, tmp_path):
    fp8 = copy.deepcopy(reference)
    experts = fp8.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.data.to(torch.float8_e4m3fn),
                                              requires_grad=False)
    with _error("FP8 experts"):
        offload(fp8, slots=4)
    mx = copy.deepcopy(reference)
    experts = mx.model.layers[1].mlp.experts
    del experts.gate_up_proj
    experts.gate_up_proj_blocks = torch.nn.Parameter(torch.zeros(8, 48, 2, 16, dtype=torch.uint8),
                                                     requires_grad=False)
    with _error("MXFP4-packed"):
        offload(mx, slots=4)
    reference.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with _error("_blocks / _scales missing"):  # MXFP4 checkpoints load (tests/test_hf_quant.py); float experts do not
        offload(tmp_path, slots=4)


def test_import_expertcache_stays_torch_free():
    code = "import sys, expertcache; assert 'torch' not in sys.modules; print(callable(expertcache.offload))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_matmul_and_slot_loop_agree(family):
    """The device strategy (one grouped matmul over slots) equals the host one (a loop over used
    slots), excluded pairs (slot id == pool size) contribute nothing, and both match eager experts."""
    from expertcache.runtime.compute import grouped_over_slots

    experts = tiny_model(family).model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    # a pool of 6 slots holding experts 7, 0, 3, 5, 1, 2 (in that slot order)
    order = [7, 0, 3, 5, 1, 2]
    pool = {k: getattr(experts, k).detach()[order].clone()
            for k in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias") if hasattr(experts, k)}
    hidden = torch.randn(5, 32, generator=gen)
    idx = torch.tensor([[7, 0], [3, 7], [5, 1], [2, 3], [0, 4]])  # expert 4 is not in the pool
    weights = torch.rand(5, 2, generator=gen)
    slot_of = {e: s for s, e in enumerate(order)}
    slot_idx = torch.tensor([[slot_of.get(e, 6) for e in row] for row in idx.tolist()])
    with torch.no_grad():
        a = grouped_over_slots(experts, hidden, slot_idx, weights, pool, grouped=True)
        b = grouped_over_slots(experts, hidden, slot_idx, weights, pool, grouped=False)
        groups = [(0, 2), (1, 2), (2, 2), (3, 1), (4, 1), (5, 1)]  # what the runtime passes in
        c = grouped_over_slots(experts, hidden, slot_idx, weights, pool, groups, grouped=False)
        keep = weights * (idx != 4)  # eager reference with expert 4's pairs weighted zero
        experts.config._experts_implementation = "eager"
        ref = experts(hidden, idx, keep)
    assert torch.equal(b, c)
    assert (a - b).abs().max().item() <= 1e-6
    assert (a - ref).abs().max().item() <= 1e-5


def test_runtime_with_the_device_matmul_strategy(reference, ids):
    """CUDA pools use one grouped matmul over all slots; run that strategy end to end here."""
    model = offload(copy.deepcopy(reference), slots=3, miss="auto")
    model.expertcache.pool.grouped = True
    _assert_same(model, reference, ids)
    assert model.expertcache.stats().total().evictions > 0


def test_auto_sends_few_token_experts_to_the_host(reference, ids, monkeypatch):
    """With a cost model whose break-even is 2 tokens, decode misses (1 token each) run on the
    host and the prompt's misses (most experts see several tokens) mostly on the device."""
    from expertcache.runtime import experts as experts_mod
    from expertcache.costmodel import Hardware

    model = offload(copy.deepcopy(reference), slots=3, miss="auto")
    model.expertcache.hardware = Hardware("split", h2d_gbps=1e-9, gpu_mem_gbps=float("inf"),
                                          cpu_mem_gbps=float("inf"), cpu_gflops=1e-9, transfer_latency_s=0.0)
    on_host = {0: 0, 1: 0}
    real = experts_mod.cpu_experts

    def spy(module, host, experts, *args):
        on_host[model.expertcache.phase] += len(experts)
        return real(module, host, experts, *args)

    monkeypatch.setattr(experts_mod, "cpu_experts", spy)
    _assert_same(model, reference, ids)
    stats = model.expertcache.stats()
    assert on_host[1] == stats.total("decode").misses > 0  # every decode miss: 1 token -> host
    assert on_host[0] < stats.total("prefill").misses      # wide prompt experts -> device


def test_device_must_exist(reference):
    with _error("no CUDA device" if not torch.cuda.is_available() else "unknown device"):
        offload(copy.deepcopy(reference), slots=4, device="cuda" if not torch.cuda.is_available() else "nope")
    with _error("unknown device"):
        offload(copy.deepcopy(reference), slots=4, device="nope")


def test_slot_counts_are_clamped_and_rounded(reference):
    # more slots than experts: the pool holds each expert once (2 layers x 8 experts)
    cache = offload(copy.deepcopy(reference), slots=1000).expertcache
    assert (cache.table.slots, cache.pool.slots) == (16, 16)
    # per-layer: whole slots per layer (7 -> 3 per layer), nothing allocated for the leftover
    cache = offload(copy.deepcopy(reference), slots=7, partition="per-layer").expertcache
    assert (cache.table.slots, cache.table.partition_capacity, cache.pool.slots) == (6, 3, 6)
    # the cpu miss path never stages: bypasses are computed on the host
    assert offload(copy.deepcopy(reference), slots=4, miss="cpu").expertcache.pool.staging == 0


def test_slot_pool_event_protocol(monkeypatch):
    """The CUDA ordering rules, checked on the CPU with recording fake streams:
    a load into a slot waits for the last compute that read it; compute waits for the copy
    stream only when it reads a slot whose copy may still be in flight."""
    from contextlib import nullcontext

    from expertcache.runtime.host import HostExperts
    from expertcache.runtime.slots import SlotPool

    log = []

    class FakeStream:
        def __init__(self, name):
            self.name, self.n = name, 0

        def record_event(self):
            self.n += 1
            return f"{self.name}-event-{self.n}"

        def wait_event(self, event):
            log.append((self.name, "waits", event))

        def wait_stream(self, other):
            log.append((self.name, "waits", other.name))

    compute, copy_stream = FakeStream("compute"), FakeStream("copy")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    host = HostExperts({"w": torch.arange(4 * 3, dtype=torch.float32).view(4, 3)})
    pool = SlotPool(host.layout(), slots=2, staging=1, device="cpu")
    pool.cuda, pool.copy_stream = True, copy_stream  # take the CUDA branches

    pool.load(0, host, 3)
    assert log == []                       # a never-read slot needs no wait
    pool.ready([1])
    assert log == []                       # slot 1 has no copy in flight
    pool.ready([0, 1])
    assert log == [("compute", "waits", "copy-event-1")]  # the event of slot 0's copy
    pool.ready([0])
    assert len(log) == 1                   # already waited: no second wait
    pool.mark_read([0, 2])
    pool.load(0, host, 1)                  # overwriting slot 0 waits for its reader
    assert log[-1] == ("copy", "waits", "compute-event-1")
    assert torch.equal(pool.tensors["w"][0], host.tensors["w"][1])
    pool.load(1, host, 2)
    assert log[-1] == ("copy", "waits", "compute-event-1")  # slot 1 never read: no new wait
    assert len(log) == 2
    # hits do not wait for misses: reading slot 0 waits for its own copy (event 2), not slot 1's
    pool.ready([0])
    assert log[-1] == ("compute", "waits", "copy-event-2")
    pool.ready([1])
    assert log[-1] == ("compute", "waits", "copy-event-3")
    pool.load(2, host, 0)                  # slot 2 was read: its copy waits for that reader
    pool.load(1, host, 0)
    pool.ready([1, 2])                     # one wait, for the later copy: the stream runs in order
    assert log[-2:] == [("copy", "waits", "compute-event-1"), ("compute", "waits", "copy-event-5")]
    pool.ready()
    assert len(log) == 6                   # both covered already
