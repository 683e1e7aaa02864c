"""host_memory='tiered': a RAM tier over the GGUF file, read around the page cache (issue 33).

The tier must compute what the all-in-RAM run computes (same tokens), count what it reads,
equal its replay in ``sim/tiers.py``, and refuse bad budgets, failed or short reads and a
file changed under it with one line that names what went wrong.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

import expertcache  # noqa: E402
from expertcache.config import CacheConfig, host_budget_rows  # noqa: E402
from expertcache.integrations.record import record  # noqa: E402
from expertcache.runtime.directio import (ALIGN, DirectFile, ExpertReadError, FileChangedError,  # noqa: E402
                                          READERS, ReadPool, read_bandwidth)
from expertcache.sim.tiers import bound, replay_tiers  # noqa: E402
from gguf_models import write_gguf  # noqa: E402
from random_file import random_file  # noqa: E402

PROMPT = torch.tensor([[5, 9, 77, 120, 3, 44, 200, 17]])
NEW = 10


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("tiers") / "tiny.gguf", "qwen3_moe", "Q8_0", layers=2, experts=16)


@pytest.fixture(scope="module")
def want(model_file):
    ref = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="copy")
    return ref.generate(PROMPT, max_new_tokens=NEW, do_sample=False)


# -- settings -------------------------------------------------------------------------------
def test_budget_spellings():
    assert host_budget_rows("25%", 128, 1000) == 32
    assert host_budget_rows(0.5, 128, 1000) == 64
    assert host_budget_rows("10KB", 128, 1000) == 10
    assert host_budget_rows("1GiB", 128, 1000) == 128  # capped at every expert
    for bad, msg in [("x%", "cannot read host_budget"), (1.5, "share of the experts"), ("0%", "share"),
                     ("lots", "cannot read memory size")]:
        with pytest.raises(ValueError, match=msg):
            CacheConfig(baseline="resident", host_memory="tiered", host_budget=bad)
    with pytest.raises(ValueError, match="needs host_budget"):
        CacheConfig(baseline="resident", host_memory="tiered")
    with pytest.raises(ValueError, match="host_budget sizes the RAM tier"):
        CacheConfig(baseline="resident", host_budget="25%")
    with pytest.raises(ValueError, match="offline oracle"):
        CacheConfig(baseline="resident", host_memory="tiered", host_budget="25%", host_policy="belady")
    assert CacheConfig(baseline="resident", host_memory="tiered", host_budget=0.25,
                       host_policy="lru").to_dict()["host_policy"] == "lru"


def test_budget_below_one_step_or_above_ram(model_file, monkeypatch):
    with pytest.raises(ValueError, match=r"holds 1 experts .* fewer than the top_k=2 one step needs"):
        expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered", host_budget="1%")
    import expertcache.runtime.tiered as tiered
    monkeypatch.setattr(tiered, "host_room", lambda: 1 << 20)  # a machine (or cgroup) with 1 MiB free
    with pytest.raises(ValueError, match=r"only 1.00 MiB of RAM is available; give a smaller host_budget"):
        expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered", host_budget="50%")


def test_auto_budget_takes_the_free_ram_less_dense_weights_and_a_margin(model_file, monkeypatch):
    """``host_budget='auto'``: the rows that fit in the free RAM (a cgroup's room counts) less the
    dense weights' file bytes and a margin of 15%, at least 2 GiB; every expert where all fit;
    refused in one line where not even one step's experts fit; refused by sim and plan."""
    import expertcache.runtime.tiered as tiered
    from expertcache.ggufmodel.header import read_header

    header = read_header(model_file)
    total, row = header.num_experts * len(header.moe_blocks), header.expert_bytes
    dense = os.path.getsize(model_file) - header.experts_bytes
    monkeypatch.setattr(tiered, "host_room", lambda: (2 << 30) + dense + 5 * row)  # margin: 2 GiB (over 15%)
    model = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered", host_budget="auto")
    assert model.expertcache.tier.rows == 5 < total
    assert "auto: " in model.expertcache.summary()["host_memory_reason"]
    gib = 1 << 30  # 100 GiB free, 10 of dense weights: 15 GiB of margin, 75 rows of 1 GiB
    assert tiered.auto_rows(100 * gib, 10 * gib, 1000, gib)[0] == 75
    monkeypatch.setattr(tiered, "host_room", lambda: 1 << 40)
    model = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered", host_budget="auto")
    assert model.expertcache.tier.rows == total
    monkeypatch.setattr(tiered, "host_room", lambda: (2 << 30) + dense + row)  # the 2 GiB margin leaves 1 row
    with pytest.raises(ValueError, match=r"host_budget='auto' holds 1 experts .*auto: .* less a 2.00 GiB margin, "
                                         r"fewer than the top_k=2"):
        expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered", host_budget="auto")
    monkeypatch.setattr(tiered, "host_room", lambda: None)
    with pytest.raises(ValueError, match="cannot be read here"):
        expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered", host_budget="auto")
    with pytest.raises(ValueError, match="sized from this machine's free RAM when a model loads"):
        host_budget_rows("auto", 128, 1000)


def test_host_room_is_the_lower_of_free_ram_and_the_cgroup(monkeypatch):
    from expertcache.runtime import device

    monkeypatch.setattr(device, "free_memory", lambda d: 8 << 30)
    monkeypatch.setattr(device, "cgroup_room", lambda: None)
    assert device.host_room() == 8 << 30
    monkeypatch.setattr(device, "cgroup_room", lambda: 1 << 30)
    assert device.host_room() == 1 << 30
    monkeypatch.setattr(device, "free_memory", lambda d: None)
    assert device.host_room() == 1 << 30


def test_cli_takes_the_tier_flags(model_file, capsys):
    from expertcache.cli import main
    code = main(["generate", str(model_file), "--device", "cpu", "--baseline", "resident", "--host-memory",
                 "tiered", "--host-budget", "25%", "--max-new-tokens", "4", "--prompt", "the cat"])
    out = capsys.readouterr().out
    assert code in (0, None) and "RAM tier" in out and "experts read" in out
    assert main(["generate", str(model_file), "--device", "cpu", "--baseline", "resident", "--host-memory",
                 "tiered", "--host-budget", "1%", "--max-new-tokens", "4", "--prompt", "the cat"]) == 2
    assert "fewer than the top_k=2" in capsys.readouterr().err
    assert main(["generate", str(model_file), "--device", "cpu", "--baseline", "resident", "--host-memory",
                 "tiered", "--host-budget", "25%", "--cpu-kernel", "torch", "--prompt", "the cat"]) == 2
    assert "past host_budget. Use --baseline cpu " in capsys.readouterr().err   # in the CLI's spelling


def test_decode_phases_count_the_tiers_hits_and_file_bytes(model_file):
    from expertcache.runtime.generate import format_summary
    model = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered", host_budget=0.25)
    model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    report, tier = model.expertcache.report(), model.expertcache.stats().pool["tier"]["decode"]
    phases = [report[f"decode_{p}"] for p in ("cold", "warm", "steady")]
    assert sum(p["tokens"] for p in phases) == 39 and all(p["ram_hit_rate"] is not None for p in phases if p["tokens"])
    # the phases' file bytes and RAM hits add up to the decode totals the tier counted
    ran = [p for p in phases if p["tokens"]]
    assert sum(p["file_bytes_per_token"] * p["tokens"] for p in ran) == pytest.approx(tier["file_bytes"])
    assert 0 < tier["file_bytes"] and any(p["ram_hit_rate"] < 1 for p in ran)
    per_token = model.config.num_hidden_layers * model.config.num_experts_per_tok  # a token's accesses
    assert tier["accesses"] == per_token * 39
    assert sum(p["ram_hit_rate"] * p["tokens"] * per_token for p in ran) == pytest.approx(tier["ram_hits"])
    assert "RAM hits" in format_summary(report) and "from the file" in format_summary(report)
    plain = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="copy")
    plain.generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert "ram_hit_rate" not in plain.expertcache.report()["decode_cold"]   # no tier, no RAM columns


# -- exactness, counters, sim == live ----------------------------------------------------------
@pytest.mark.parametrize("settings", [
    dict(baseline="resident"),                      # the CPU engine computes from the RAM tier
    dict(slots=6),                                  # slot misses served from RAM, else the file
    dict(slots=6, miss="cpu", eviction="lru"),
    dict(baseline="cpu"),
], ids=["resident", "slots", "slots-cpu-miss", "baseline-cpu"])
def test_tokens_equal_all_in_ram_and_sim_equals_live(model_file, want, settings):
    model = expertcache.offload(model_file, device="cpu", host_memory="tiered", host_budget=0.25, **settings)
    cache = model.expertcache
    # a cold run: through the one-graph decode where it runs (resident: runtime/ggmltier.py)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW, do_sample=False), want)
    live = cache.stats().pool["tier"]
    graph = getattr(model, "_expertcache_graph", None)
    assert (graph is not None and graph.steps == NEW - 1) == (settings == dict(baseline="resident"))
    trace = record(model, PROMPT, NEW)  # the same tokens, their routing recorded (on the eager path)
    gpu = 0 if cache.host_resident or settings.get("baseline") else 6
    sim = replay_tiers(trace, cache.tier.rows, "default", gpu, settings.get("eviction", "default"),
                       expert_bytes=cache.expert_bytes)
    for phase in ("prefill", "decode"):
        replayed = sim.to_dict()[phase]
        assert (live[phase]["accesses"], live[phase]["ram_hits"], live[phase]["file_reads"]) == \
            (replayed["ram_accesses"], replayed["ram_hits"], replayed["file_reads"]), phase
        assert live[phase]["tokens"] == replayed["tokens"]
    d = live["decode"]
    assert d["file_reads"] > 0 and d["ram_hits"] > 0  # the tier both hit and read
    assert d["file_bytes"] == d["file_reads"] * cache.expert_bytes  # each read: one expert's bytes
    ahead = live.get("prefetch")  # the graph's read-ahead: its bytes not in file_bytes unless used
    if ahead is not None:
        assert ahead["used"] + ahead["wasted"] + ahead["pending"] == ahead["read_ahead"] > 0 and ahead["used"] <= d["file_reads"]
    assert d["disk_bytes"] >= d["file_bytes"] and d["read_seconds"] > 0
    assert "RAM tier" in str(cache.stats())


def test_kernel_aio_or_reader_threads_same_tokens(model_file, want, monkeypatch):
    """The tier reads through kernel AIO where this machine allows it, else (and when turned off)
    through reader threads, and says which and why; the tokens are the same either way."""
    from expertcache.runtime.kernelaio import open_aio
    probe = DirectFile(model_file, os.path.getsize(model_file))
    pool, why = open_aio([probe])
    probe.close()
    if pool is not None:
        pool.close()
    for off in (False, True):
        if off:
            monkeypatch.setenv("EXPERTCACHE_AIO", "0")
            why = why or "kernel AIO turned off (EXPERTCACHE_AIO=0)"
        model = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered",
                                    host_budget=0.25)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW, do_sample=False), want)
        tier = model.expertcache.stats().pool["tier"]
        assert tier["reader"] == ("kernel AIO" if pool is not None and not off else f"{READERS} reader threads ({why})")
        assert tier["decode"]["file_reads"] > 0


def test_a_step_wider_than_the_tier_reads_around_it(model_file, want):
    """8 RAM rows, a 8-token prompt needing more experts of a layer: bypassed experts are read into a
    compact copy for that step only, and the output does not change."""
    model = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered",
                                host_budget=3 / 32)
    assert model.expertcache.tier.rows == 3
    assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW, do_sample=False), want)
    assert model.expertcache.tier.table.stats().sums("prefill")["bypasses"] > 0


def test_the_bound_is_belady_and_no_policy_beats_it(model_file):
    """Decode steps (a one-token prompt) all fit the tier: Belady reads the fewest experts, with or
    without device slots in front; without them it is the simulator's own Belady replay."""
    from expertcache.sim import replay
    model = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered",
                                host_budget=0.25)
    trace = record(model, torch.tensor([[7]]), 24)
    rows = model.expertcache.tier.rows
    best, what = bound(trace, rows)
    assert best.phase(1)["ram_hits"] == replay(trace, "belady", rows, engine="table").hits
    assert "optimum of file reads" in what
    for gpu in (0, 6):
        best, what = bound(trace, rows, gpu, "lru")
        for policy in ("lru", "fifo", "default", "s3fifo"):
            assert best.phase(1)["file_reads"] <= replay_tiers(trace, rows, policy, gpu, "lru").phase(1)["file_reads"]
    assert "no joint optimum" in what


# -- reads ----------------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False])
def test_unaligned_ranges_read_exactly(tmp_path, direct):
    path, data = random_file(tmp_path)
    f = DirectFile(path, len(data), direct=direct)
    pool = ReadPool(2)
    try:
        jobs = [(f, np.empty(n, np.uint8), off, f"range {off}") for off, n in
                [(0, 10), (5, ALIGN), (ALIGN - 3, 7), (2 * ALIGN + 1, ALIGN + 99)]]
        got = pool.read(jobs)
        for _, dst, off, _ in jobs:
            assert np.array_equal(dst, data[off:off + dst.nbytes])
        assert got.reads == 4 and got.bytes == sum(j[1].nbytes for j in jobs)
        assert got.disk_bytes % ALIGN == 0 and got.disk_bytes >= got.bytes
    finally:
        pool.close()
        f.close()
    if not direct:
        assert "posix_fadvise DONTNEED" in f.mode_reason


def test_settle_returns_once_each_reader_holds_a_read(tmp_path):
    """``ReadPool.settle`` waits for the first reads of a batch (one a reader thread) to begin,
    not for them to end, and every read still lands exactly."""
    import threading

    path, data = random_file(tmp_path)
    f = DirectFile(path, len(data))
    pool = ReadPool(2)
    gate, begun = threading.Event(), []

    class Held:  # a file whose reads begin, then wait for the gate
        def read_into(self, *args):
            begun.append(args[1])
            gate.wait(5)
            return f.read_into(*args)
    try:
        jobs = [(Held(), np.empty(100, np.uint8), off, f"range {off}") for off in (0, 3000, 9000)]
        started = threading.Semaphore(0)
        futures = pool.submit(jobs, started)
        pool.settle(started, len(jobs), timeout=5)
        assert sorted(begun) == [0, 3000] and not any(fut.done() for fut in futures)  # 2 readers, held
        gate.set()
        got = ReadPool.collect(futures, 0.0)
        assert got.reads == 3
        for _, dst, off, _ in jobs:
            assert np.array_equal(dst, data[off:off + 100])
    finally:
        gate.set()
        pool.close()
        f.close()


def test_o_direct_refused_falls_back_and_says_so(tmp_path, monkeypatch):
    path, data = random_file(tmp_path)
    real_open = os.open

    def refuse(p, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(p, flags, *a)
    monkeypatch.setattr(os, "open", refuse)
    f = DirectFile(path, len(data))
    assert not f.direct and "O_DIRECT refused by the file system (Invalid argument)" in f.mode_reason
    dst = np.empty(50, np.uint8)
    f.read_into(dst, 1000, "x")
    assert np.array_equal(dst, data[1000:1050])
    f.close()


def test_short_read_names_file_offset_and_expert(tmp_path):
    path, data = random_file(tmp_path)
    f = DirectFile(path, len(data))
    os.truncate(path, ALIGN)  # the file shrinks under us
    with pytest.raises(ExpertReadError, match=rf"{path.name}: short read of layer 1 expert 7 .* at offset 5000"):
        f.read_into(np.empty(100, np.uint8), 5000, "layer 1 expert 7 (down.weight)")
    f.close()


def test_read_error_names_file_offset_and_expert(tmp_path):
    path, data = random_file(tmp_path)
    f = DirectFile(path, len(data))
    real = f.fd
    f.fd = os.open(os.devnull, os.O_WRONLY)  # reading a write-only descriptor fails: EBADF
    with pytest.raises(ExpertReadError, match=r"data.bin: reading layer 0 expert 3 .*offset 4096.* failed"):
        f.read_into(np.empty(100, np.uint8), 4096, "layer 0 expert 3 (up.weight)")
    os.close(f.fd)
    f.fd = real
    f.close()


def test_a_file_too_short_for_its_header_is_refused(tmp_path):
    path, data = random_file(tmp_path)
    with pytest.raises(FileChangedError, match=r"header places expert bytes up to offset"):
        DirectFile(path, len(data) + 1)


def test_a_file_changed_under_the_model_is_caught(model_file, tmp_path):
    import shutil
    path = tmp_path / "copy.gguf"
    shutil.copy(model_file, path)
    model = expertcache.offload(path, device="cpu", baseline="resident", host_memory="tiered", host_budget=0.25)
    with open(path, "r+b") as f:  # rewritten in place, same size
        f.seek(-4096, os.SEEK_END)
        f.write(bytes(4096))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # coarse clocks: the write's time differs
    with pytest.raises(FileChangedError, match=r"copy.gguf changed after it was loaded"):
        model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)


def test_a_failed_step_stops_the_tier(model_file, monkeypatch):
    """The per-layer path: a read that fails ends the forward naming the expert; the rows its step
    was filling may hold other experts' bytes, so every later step is refused, in one line."""
    from expertcache.runtime import directio, tiered

    model = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered",
                                host_budget=0.25, cpu_graph="off")
    land = directio.DirectFile.land

    def failing(self, got, start, offset, dst, what, put=None):
        raise self.failed(5, what, dst.nbytes, offset)
    monkeypatch.setattr(directio.DirectFile, "land", failing)
    with pytest.raises(ExpertReadError, match=r"reading layer 0 expert \d+ .* failed: Input/output error"):
        model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    monkeypatch.setattr(directio.DirectFile, "land", land)
    with pytest.raises(tiered.TierBrokenError, match=r"RAM tier stopped after a failed step .*reload the model"):
        model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)


def test_descriptors_close_with_their_file(tmp_path):
    import gc
    path, data = random_file(tmp_path)
    f = DirectFile(path, len(data))
    fd = f.fd
    del f
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_read_bandwidth_is_measured(tmp_path):
    path, _ = random_file(tmp_path, 64 * ALIGN)
    assert read_bandwidth(path, block=8 * ALIGN) > 0


# -- plan and probe ----------------------------------------------------------------------------
def test_plan_with_a_ram_tier_pays_the_file_reads():
    from dataclasses import replace

    from expertcache.costmodel import load_hardware, model_experts
    from expertcache.costmodel.model import file_read_time
    from expertcache.sim.plan import plan
    from expertcache.trace.synth import synth_trace

    model = model_experts("qwen3-30b-a3b", "Q4_K")
    trace = synth_trace("qwen3-30b-a3b", 200)
    hw = replace(load_hardware("pcie4-consumer"), disk_gbps=2.0)
    flat = {r["config"]: r for r in plan(model, "4GiB", hw, trace, ["lru"])["rows"]}
    tiered = plan(model, "4GiB", hw, trace, ["lru"], host_budget="25%")
    assert tiered["ram_rows"] == round(0.25 * 48 * 128)
    for row in tiered["rows"]:
        reads = row["file_reads_per_token"]
        assert reads is not None and 0 < row["ram_hit_rate"] < 1
        want = 1 / (1 / flat[row["config"]]["tok_s"] + file_read_time(reads, model.cost, hw))
        assert row["tok_s"] == pytest.approx(want)  # the reads at disk_gbps, on top of the rest
    cep = next(r for r in tiered["rows"] if r["config"] == "copy-every-pass")
    cached = max((r for r in tiered["rows"] if r["slots"]), key=lambda r: r["slots"])
    assert cached["file_reads_per_token"] < cep["file_reads_per_token"]  # slots in front: fewer reach RAM
    with pytest.raises(ValueError, match="no disk_gbps"):
        plan(model, "4GiB", load_hardware("pcie4-consumer"), trace, ["lru"], host_budget="25%")


def test_plan_cli_needs_a_disk_rate_for_a_ram_tier(capsys):
    from expertcache.cli import main
    assert main(["plan", "qwen3-30b-a3b", "--quant", "Q4_K", "--gpu-memory", "4GiB", "--host-budget", "25%",
                 "--tokens", "100"]) == 2
    assert "--disk-gbps" in capsys.readouterr().err
    assert main(["plan", "qwen3-30b-a3b", "--quant", "Q4_K", "--gpu-memory", "4GiB", "--host-budget", "25%",
                 "--disk-gbps", "1.5", "--tokens", "100", "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert "RAM tier: 1536 of 6144 experts" in out and "file reads/token" in out


def test_probe_measures_the_disk(tmp_path, capsys):
    import json

    from expertcache.cli import main
    from expertcache.costmodel.hardware import load_hardware
    path, _ = random_file(tmp_path, 256 * ALIGN)
    out = tmp_path / "hw.json"
    assert main(["probe", "--seconds", "0.02", "--disk", str(path), "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["disk_gbps"] > 0 and "disk_gbps" in data["measured"]
    assert load_hardware(out).disk_gbps == data["disk_gbps"]


def test_sim_cli_replays_the_ram_tier(model_file, tmp_path, capsys):
    import json

    from expertcache.cli import main
    from expertcache.trace.format import save_trace
    model = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered",
                                host_budget=0.25)
    trace = record(model, torch.tensor([[7]]), 16)
    path = save_trace(trace, tmp_path / "t.npz")
    out = tmp_path / "tiers.json"
    assert main(["sim", str(path), "--slots", "0,6", "--policy", "lru", "--host-budget", "25%",
                 "--expert-bytes", "1000", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "RAM tier 8 of 32 experts" in text and "bound reads/token" in text
    doc = json.loads(out.read_text())
    live = model.expertcache.stats().pool["tier"]["decode"]
    first = doc["results"][0]  # slots 0: the CPU engine's stream, as the live run met it
    assert (first["decode"]["ram_hits"], first["decode"]["file_reads"]) == (live["ram_hits"], live["file_reads"])
    assert doc["results"][1]["decode"]["gpu_hits"] > 0


def test_resident_slots_over_a_tier_are_refused_on_the_cpu(model_file, want):
    """baseline='resident' with dequantized CPU slots would copy every expert into RAM slots, past
    host_budget (on CUDA the slots are the device's: tests/test_tiers_gpu.py fills them through the
    tier). Refused in one line that names the way out; baseline='cpu' computes every expert from the
    tier's rows and decodes the same tokens."""
    with pytest.raises(ValueError, match=r"baseline='resident' with host_memory='tiered' on the CPU .*"
                                         r"dequantized slots .*past host_budget. Use baseline='cpu'"):
        expertcache.offload(model_file, device="cpu", baseline="resident", slot_format="dequantized",
                            cpu_kernel="torch", host_memory="tiered", host_budget=0.25)
    model = expertcache.offload(model_file, device="cpu", baseline="cpu", slot_format="dequantized",
                                cpu_kernel="torch", host_memory="tiered", host_budget=0.25)
    cache = model.expertcache
    assert cache.pool.slots == 0 and cache.tier.stats()["prefill"]["file_reads"] == 0  # nothing read at load
    ref = expertcache.offload(model_file, device="cpu", baseline="resident", slot_format="dequantized",
                              cpu_kernel="torch", host_memory="copy")
    got = model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, ref.generate(PROMPT, max_new_tokens=NEW, do_sample=False))
    assert cache.tier.stats()["decode"]["accesses"] > 0  # decode asks the tier


def test_a_model_that_is_not_a_gguf_file_is_refused():
    from tiny_moe import tiny_model
    with pytest.raises(ValueError, match="host_memory=.tiered. reads experts by offset from a GGUF file or a safetensors checkpoint directory.*pass the model.s path"):
        expertcache.offload(tiny_model("qwen3_moe"), device="cpu", slots=4, host_memory="tiered", host_budget="25%")


def test_a_tier_keeps_the_host_planner_and_says_why(model_file):
    """The device step cannot read the file: planner='device' is refused, and planner='auto' takes
    the host planner even where decode would be captured (graphs='on')."""
    for planner, words in (("device", "planner='device' refused, host planner used: "),
                           ("auto", "planner='auto': host, the device step cannot run: ")):
        model = expertcache.offload(model_file, device="cpu", slots=8, host_memory="tiered", host_budget=0.5,
                                    planner=planner, graphs="on")
        summary = model.expertcache.summary()
        assert summary["planner"] == "host"
        assert summary["planner_reason"] == words + ("host_memory='tiered' reads missing experts from the "
                                                     "file, which the device cannot do")


def test_reads_overlap_the_hits_and_the_logits_stay_bit_equal(model_file, monkeypatch):
    """The resident CPU step computes its RAM hits while its misses are read (``_overlapped``); the
    logits equal the all-in-RAM run's bit for bit."""
    import expertcache.runtime.tiered as tiered
    calls = []
    real = tiered._overlapped
    monkeypatch.setattr(tiered, "_overlapped", lambda *a: calls.append(1) or real(*a))
    kw = dict(max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    # the per-layer ggml path, tiered and all in RAM (the one-graph decode's rounding differs from
    # it: docs/cpu.md; the tier through the graph: tests/test_ggml_tier.py)
    ref = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="copy",
                              cpu_graph="off").generate(PROMPT, **kw)
    model = expertcache.offload(model_file, device="cpu", baseline="resident", host_memory="tiered",
                                host_budget=0.25, cpu_graph="off")
    got = model.generate(PROMPT, **kw)
    assert len(calls) > 0
    assert all(torch.equal(a, b) for a, b in zip(got.logits, ref.logits))
    d = model.expertcache.stats().pool["tier"]["decode"]
    assert 0 <= d["wait_seconds"] <= d["read_seconds"] + 1e-3


def test_hardware_disk_rate_is_checked():
    from dataclasses import replace

    from expertcache.costmodel import ExpertCost, load_hardware
    from expertcache.costmodel.model import file_read_time
    hw = load_hardware("pcie4-consumer")
    for bad in (0, -1.0, True, "fast"):
        with pytest.raises(ValueError, match="disk_gbps must be a positive number or null"):
            replace(hw, disk_gbps=bad)
    assert file_read_time(3, ExpertCost(2_000_000), replace(hw, disk_gbps=2.0)) == pytest.approx(3e-3)


def test_a_split_gguf_reads_each_part_from_its_own_file(tmp_path, want):
    first = write_gguf(tmp_path / "split.gguf", "qwen3_moe", "Q8_0", layers=2, experts=16, split_max_tensors=8)
    model = expertcache.offload(first, device="cpu", baseline="resident", host_memory="tiered", host_budget=0.25)
    assert len(model.expertcache.tier.files) > 1
    assert torch.equal(model.generate(PROMPT, max_new_tokens=NEW, do_sample=False), want)


def test_mmap_past_the_free_ram_names_the_tier(monkeypatch):
    """``host_memory='auto'`` falls back to the memory-mapped file past 80% of the free RAM; its
    reason then names what beat the page cache there (docs/tiers.md)."""
    import torch

    from expertcache.runtime import host

    monkeypatch.setattr(host, "free_memory", lambda device: 10 << 30)
    mode, why = host.host_mode("auto", torch.device("cpu"), "GGUF experts", 9 << 30)
    assert mode == "mmap" and "host_memory='tiered', host_budget='auto'" in why
    mode, why = host.host_mode("auto", torch.device("cpu"), "GGUF experts", 1 << 30)
    assert mode == "mmap" and "tiered" not in why
