"""The graph's weights repacked for ggml's faster CPU kernels (``quant/ggmlrepack.py``, issue 32):
the same outputs as reading them in place, the file's pages released and still correct when
read again, anonymous memory never released, and 'auto' keeping a model that would not fit.

Repacking reorders the blocks and the kernels sum in another order: logits differ from the
in-place path by float rounding only (measured 1-3e-7 relative L2 on these fixtures), below
``test_ggml_graph.FLOAT_TOL``."""

from __future__ import annotations

import pytest
import torch

import expertcache
from expertcache.config import CacheConfig
from expertcache.quant import ggml, ggmlrepack
from gguf_models import write_gguf

pytestmark = pytest.mark.skipif(not ggml.available()[0], reason=f"ggml kernels: {ggml.available()[1]}")
Q4_0 = 2
PROMPT = torch.tensor([[100, 101, 102, 103, 104]])


def _repacking():
    """Skip where this CPU's ggml repacks nothing (the layouts are per instruction set)."""
    if ggmlrepack.repack_buffer_type() is None:
        pytest.skip("this ggml build has no CPU_REPACK buffer type")
    probe = torch.zeros(8 * 18, dtype=torch.uint8)          # 8 rows of one Q4_0 block (18 bytes)
    if ggmlrepack.Repacked().tensor(Q4_0, (32, 8), probe.data_ptr()) is None:
        pytest.skip("ggml repacks no Q4_0 weight on this CPU (no AVX2 / NEON layout)")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("repack") / "m.gguf", "qwen3_moe", "Q4_0", dense_type="Q4_K")


def _logits(model, steps: int = 6) -> tuple[list[int], torch.Tensor]:
    tokens, rows = [], []
    with torch.no_grad():
        out = model(PROMPT, use_cache=True)
        for _ in range(steps):
            tok = out.logits[:, -1:].argmax(-1)
            tokens.append(tok.item())
            out = model(tok, past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0, -1])
    return tokens, torch.stack(rows)


def test_repacked_equals_in_place_and_the_file_still_reads_back(path):
    _repacking()
    packed = expertcache.offload(path, device="cpu", baseline="resident")
    in_place = expertcache.offload(path, device="cpu", baseline="resident", cpu_repack="off")
    reason = packed.expertcache.summary()["cpu_graph_reason"]
    # 2 layers x (3 experts + 4 attention); the lm_head (263 rows, not a multiple of 8) is read in place
    assert "14 weights repacked for ggml's CPU kernels" in reason
    assert "cpu_repack='off': weights read in place" in in_place.expertcache.summary()["cpu_graph_reason"]
    (tokens, logits), (want, want_logits) = _logits(packed), _logits(in_place)
    assert tokens == want
    assert ((logits - want_logits).norm() / want_logits.norm()).item() < 1e-5
    # the experts' file pages were released (a clean file mapping), and read back they are the file's
    repacked = packed._expertcache_graph.repacked
    host, ref = packed.expertcache.hosts[0], in_place.expertcache.hosts[0]
    for part, t in host.tensors.items():
        assert any(lo <= t.data_ptr() < hi for lo, hi in repacked._mapped)
        assert torch.equal(t, ref.tensors[part])
    # and the per-layer path, which reads them in place, still computes what it did
    packed._expertcache_graph.enabled = in_place._expertcache_graph.enabled = False
    assert _logits(packed)[0] == _logits(in_place)[0]


def test_anonymous_memory_is_never_released():
    """MADV_DONTNEED zeroes anonymous pages: a weight held in a tensor keeps its bytes."""
    _repacking()
    weight = torch.randint(0, 256, (64 * 18 * 64,), dtype=torch.uint8)      # 64 rows of 64 blocks
    weight.view(-1, 18)[:, :2] = torch.tensor([0, 60], dtype=torch.uint8)   # scales 1.0 (f16)
    before = weight.clone()
    repacked = ggmlrepack.Repacked()
    assert repacked.tensor(Q4_0, (32 * 64, 64), weight.data_ptr()) is not None
    assert repacked.tensors == 1 and torch.equal(weight, before)
    assert not any(lo <= weight.data_ptr() < hi for lo, hi in ggmlrepack.clean_file_maps())


def test_auto_reads_a_model_over_half_the_free_memory_in_place(path, monkeypatch):
    from expertcache.runtime import device

    monkeypatch.setattr(device, "free_memory", lambda dev: 2 ** 20)      # 1 MiB free
    model = expertcache.offload(path, device="cpu", baseline="resident")
    reason = model.expertcache.summary()["cpu_graph_reason"]
    assert "cpu_repack='auto': weights read in place (0.0 GiB of quantized weights, over half the 0.0 GiB free)" in reason
    assert model._expertcache_graph.repacked is None


def test_auto_takes_the_memory_cgroups_room(path, monkeypatch):
    """Under a memory cgroup the limit binds before MemAvailable (a tiered bench's mmap run
    repacked every expert and was killed in its limit)."""
    from expertcache.runtime import device

    monkeypatch.setattr(device, "free_memory", lambda dev: 2 ** 40)
    monkeypatch.setattr(device, "cgroup_room", lambda: 2 ** 20)
    model = expertcache.offload(path, device="cpu", baseline="resident")
    assert "over half the 0.0 GiB free" in model.expertcache.summary()["cpu_graph_reason"]


def test_cgroup_room_reads_v1_and_v2(tmp_path, monkeypatch):
    from expertcache.runtime import device

    real_open = open
    files = {"/proc/self/cgroup": "12:memory:/bench\n0::/\n",
             "/sys/fs/cgroup/memory/bench/memory.limit_in_bytes": "1000000\n",
             "/sys/fs/cgroup/memory/bench/memory.usage_in_bytes": "400000\n"}

    def fake(name, *args, **kwargs):
        if name in files:
            (tmp_path / "f").write_text(files[name])
            return real_open(tmp_path / "f", *args, **kwargs)
        if str(name).startswith(("/sys/fs/cgroup", "/proc/self/cgroup")):
            raise OSError(name)
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake)
    assert device.cgroup_room() == 600000                            # v1: limit - usage
    files["/sys/fs/cgroup/memory/bench/memory.limit_in_bytes"] = str(2 ** 63 - 4096)
    files.update({"/sys/fs/cgroup/memory.max": "max\n", "/sys/fs/cgroup/memory.current": "5\n"})
    assert device.cgroup_room() is None                              # no limit in either
    files["/sys/fs/cgroup/memory.max"] = "105\n"
    assert device.cgroup_room() == 100                               # v2


def test_the_setting_is_checked_and_reaches_the_config():
    import argparse

    from expertcache.cli.options import add_cache_options, cache_config

    with pytest.raises(ValueError, match="cpu_repack"):
        CacheConfig(cpu_repack="on")
    p = argparse.ArgumentParser()
    add_cache_options(p)
    assert cache_config(p.parse_args(["--baseline", "resident", "--cpu-repack", "off"])).cpu_repack == "off"
    assert cache_config(p.parse_args(["--baseline", "resident"])).cpu_repack == "auto"


def test_row_repack_is_the_stacked_layout_and_its_kernel():
    """``RowRepack`` (the RAM tier's rows): experts repacked one by one, back to back, are the bytes
    ggml's own repack of the whole stack [cols, rows, E] gives, with the same traits; a
    ``mul_mat_id`` over them marked repacked computes the plain kernel's result within float
    rounding (a stride wider than an expert, as a tier row of a mixed-type model, included)."""
    _repacking()
    import ctypes

    import numpy as np

    I, H, E, T, K = 64, 96, 5, 3, 2                                      # [I, H] gate / up, [H, I] down
    rng = np.random.default_rng(0)

    def q4(rows, cols, stride):                                          # E experts, random blocks
        a = np.zeros((E, stride), np.uint8)
        blocks = rng.integers(0, 256, (E, rows * cols // 32, 18), dtype=np.uint8)
        blocks[:, :, 0], blocks[:, :, 1] = 0, rng.choice([0x20, 0x24, 0x28], blocks.shape[:2])  # f16 scales
        a[:, :blocks[0].size] = blocks.reshape(E, -1)
        return a

    packers = [ggmlrepack.RowRepack.of(Q4_0, H, I), ggmlrepack.RowRepack.of(Q4_0, H, I),
               ggmlrepack.RowRepack.of(Q4_0, I, H)]
    plain = [q4(I, H, p.nbytes) for p in packers[:2]] + [q4(H, I, packers[2].nbytes + 64)]
    packed = [np.zeros_like(a) for a in plain]
    for a, out, p in zip(plain, packed, packers):
        for e in range(E):
            p.pack(out[e].ctypes.data, a[e].ctypes.data)
    repacked = ggmlrepack.Repacked()                                     # holds the stack's buffer
    stack = repacked.tensor(Q4_0, (H, I, E), plain[0].ctypes.data, plain[0].shape[1])
    whole = np.ctypeslib.as_array((ctypes.c_uint8 * plain[0].size).from_address(stack.contents.data))
    assert np.array_equal(whole.reshape(E, -1), packed[0]) and stack.contents.extra == packers[0].extra

    gen = torch.Generator().manual_seed(0)
    x, ids = torch.randn(T, H, generator=gen), torch.randint(0, E, (T, K), dtype=torch.int32, generator=gen)
    outs = []
    for weights, marks in ((plain, [None] * 3), (packed, packers), (packed, [None] * 3)):
        ws = [ggml.Weight(Q4_0, *((I, H) if i < 2 else (H, I)), E, w.shape[1], m)
              for i, (w, m) in enumerate(zip(weights, marks))]
        out = torch.empty(T * K, H)                                       # [T*K, H]
        ggml.SiluMlpId(*ws, T, K, 1)([w.ctypes.data for w in weights], x.data_ptr(), ids.data_ptr(), out.data_ptr())
        outs.append(out)
    assert ((outs[1] - outs[0]).norm() / outs[0].norm()).item() < 1e-5
    assert not torch.allclose(outs[2], outs[0], rtol=0.1, atol=0.1)   # unmarked: the plain kernel misreads them
    assert ggmlrepack.RowRepack.of(8, H, I) is None                      # Q8_0: no x86 layout (NEON has one)
