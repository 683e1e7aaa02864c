"""imatrix files: GGUF fixtures written here with gguf.GGUFWriter, a legacy .dat
written byte by byte, plus the other count sources and the CLI."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from expertcache.cli import main
from expertcache.imatrix import ImatrixError, LegacyImatrixError, load_counts, read, trace_counts
from expertcache.trace import Trace, save_trace
from png_check import pixels  # tests/ is on sys.path (not a package)


SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def shared_trace(name: str) -> Path:
    # Same rule as conftest.shared_trace (imported modules cannot see conftest here).
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"shared data {path} is absent (read from ../shared/traces, never copied in)")
    return path

# 3 MoE layers x 6 experts, with experts nobody routed to (zeros).
COUNTS = np.array([[40, 0, 25, 10, 0, 5],
                   [0, 0, 0, 60, 15, 5],
                   [12, 13, 14, 15, 16, 10]], dtype=np.int64)


def write_imatrix(path, counts=COUNTS, *, blocks=None, kinds=("gate", "up", "down"), n_in=4,
                  override=None, dense=True, general_type="imatrix", in_sum=True):
    """An imatrix GGUF laid out as llama-imatrix writes it (no general.architecture).

    ``override`` maps (block, kind) -> counts for that one tensor (to make them disagree).
    """
    writer = gguf.GGUFWriter(str(path), arch="")
    writer.kv_data[0].pop("general.architecture", None)
    writer.add_type(general_type)
    writer.add_array("imatrix.datasets", ["wiki.train.raw", "code.txt"])
    writer.add_uint32("imatrix.chunk_count", 125)
    writer.add_uint32("imatrix.chunk_size", 512)
    blocks = list(range(len(counts))) if blocks is None else blocks
    for block, row in zip(blocks, counts):
        E = len(row)
        for kind in kinds:
            name = f"blk.{block}.ffn_{kind}_exps.weight"
            values = np.asarray((override or {}).get((block, kind), row), dtype=np.float32)
            writer.add_tensor(f"{name}.in_sum2", np.full((E, n_in), 2.0, np.float32))   # ne [n_in, E]
            writer.add_tensor(f"{name}.counts", values.reshape(-1, 1))                  # ne [1, E]
            if in_sum:
                writer.add_tensor(f"{name}.in_sum", np.ones((E, n_in), np.float32))
        if dense:  # a dense weight: one count, must be ignored
            writer.add_tensor(f"blk.{block}.attn_q.weight.in_sum2", np.ones((1, n_in), np.float32))
            writer.add_tensor(f"blk.{block}.attn_q.weight.counts", np.array([[999.0]], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_dense_only(path):
    writer = gguf.GGUFWriter(str(path), arch="")
    writer.kv_data[0].pop("general.architecture", None)
    writer.add_type("imatrix")
    for block in range(2):
        writer.add_tensor(f"blk.{block}.ffn_up.weight.in_sum2", np.ones((1, 8), np.float32))
        writer.add_tensor(f"blk.{block}.ffn_up.weight.counts", np.array([[512.0]], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_legacy_dat(path, entries, last_chunk=None, dataset=None):
    """The legacy layout, little-endian: int32 n; per entry int32 len, name, int32 ncall,
    int32 nval, float32[nval]; then optionally int32 last_chunk, int32 len, dataset."""
    out = bytearray(struct.pack("<i", len(entries)))
    for name, ncall, values in entries:
        raw = name.encode()
        out += struct.pack("<i", len(raw)) + raw
        out += struct.pack("<ii", ncall, len(values)) + struct.pack(f"<{len(values)}f", *values)
    if last_chunk is not None:
        out += struct.pack("<i", last_chunk)
        if dataset is not None:
            out += struct.pack("<i", len(dataset.encode())) + dataset.encode()
    path.write_bytes(bytes(out))
    return path


# -- GGUF imatrix ---------------------------------------------------------------
def test_reads_counts_and_metadata(tmp_path):
    result = read(write_imatrix(tmp_path / "imatrix.gguf"))
    assert result.counts.dtype == np.int64
    np.testing.assert_array_equal(result.counts, COUNTS)
    assert result.kind == "imatrix"
    assert result.meta["datasets"] == ["wiki.train.raw", "code.txt"]
    assert result.meta["chunk_count"] == 125 and result.meta["chunk_size"] == 512
    assert result.meta["blocks"] == [0, 1, 2]


def test_rows_follow_moe_blocks_when_dense_blocks_come_first(tmp_path):
    # DeepSeek-style: blocks 0 has no experts; rows are MoE layers in block order.
    result = read(write_imatrix(tmp_path / "i.gguf", blocks=[3, 1, 7]))
    assert result.meta["blocks"] == [1, 3, 7]
    np.testing.assert_array_equal(result.counts, COUNTS[[1, 0, 2]])


def test_fused_gate_up_and_no_in_sum(tmp_path):
    result = read(write_imatrix(tmp_path / "i.gguf", kinds=("gate_up", "down"), in_sum=False))
    np.testing.assert_array_equal(result.counts, COUNTS)


def test_mismatched_gate_up_down_counts(tmp_path):
    bad = COUNTS[1].copy()
    bad[4] += 3
    path = write_imatrix(tmp_path / "i.gguf", override={(1, "down"): bad})
    with pytest.raises(ImatrixError, match=r"blk\.1 disagree between ffn_gate_exps and ffn_down_exps \(expert 4: 15 vs 18 tokens"):
        read(path)


def test_mismatched_expert_numbers_within_a_layer(tmp_path):
    path = write_imatrix(tmp_path / "i.gguf", override={(0, "up"): [1, 2, 3]})
    with pytest.raises(ImatrixError, match="6 vs 3 experts"):
        read(path)


def test_layers_with_different_expert_numbers(tmp_path):
    path = write_imatrix(tmp_path / "i.gguf", counts=[[1, 2, 3, 4], [1, 2]])
    with pytest.raises(ImatrixError, match="disagree on the number of experts"):
        read(path)


def test_dense_only_imatrix(tmp_path):
    with pytest.raises(ImatrixError, match="no expert tensors.*dense model"):
        read(write_dense_only(tmp_path / "dense.gguf"))


@pytest.mark.parametrize("keep", [0.02, 0.3, 0.6, 0.97])
def test_truncated_file_names_the_file(tmp_path, keep):
    full = write_imatrix(tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[:max(4, int(len(full) * keep))])
    with pytest.raises(ImatrixError, match=r"cut\.gguf.*(truncated|corrupt)"):
        read(cut)


def test_model_gguf_is_not_an_imatrix(tmp_path):
    path = write_imatrix(tmp_path / "model.gguf", general_type="model")
    with pytest.raises(ImatrixError, match="not an imatrix"):
        read(path)


def test_flat_counts_from_a_converted_legacy_file_are_refused(tmp_path):
    flat = np.full((2, 4), 1024)
    with pytest.raises(ImatrixError, match="same count.*legacy"):
        read(write_imatrix(tmp_path / "i.gguf", counts=flat))


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="imatrix file not found"):
        read("/nonexistent/imatrix.gguf")


# -- legacy .dat -------------------------------------------------------------------
def test_legacy_dat_is_recognised_and_explained(tmp_path):
    path = write_legacy_dat(tmp_path / "imatrix.dat", [
        ("blk.0.attn_q.weight", 10, [1.0, 2.0, 3.0, 4.0]),
        ("blk.0.ffn_up_exps.weight", 10, [0.5] * 8),
        ("blk.0.ffn_down_exps.weight", 10, [0.5] * 8),
    ], last_chunk=10, dataset="wiki.train.raw")
    with pytest.raises(LegacyImatrixError) as err:
        read(path)
    message = str(err.value)
    assert "legacy imatrix.dat" in message and "3 tensors, 2 of them MoE expert tensors" in message
    assert "10 chunks" in message and "wiki.train.raw" in message
    assert "cannot rank experts" in message and "GGUF" in message


def test_oldest_legacy_dat_without_trailer(tmp_path):
    path = write_legacy_dat(tmp_path / "old.dat", [("blk.0.ffn_up_exps.weight", 3, [1.0, 1.0])])
    with pytest.raises(LegacyImatrixError, match="1 of them MoE"):
        load_counts(path)


def test_random_bytes_are_neither_format(tmp_path):
    path = tmp_path / "noise.dat"
    path.write_bytes(np.random.default_rng(0).bytes(300))
    with pytest.raises(ImatrixError, match="neither a GGUF imatrix nor a legacy") as err:
        read(path)
    assert not isinstance(err.value, LegacyImatrixError)


# -- other sources -----------------------------------------------------------------
def tiny_trace():
    experts = np.array([[[0, 1], [0, 2], [3, 0]],      # layer 0: 3 tokens, top-2
                        [[2, 3], [2, 1], [2, 3]]], dtype=np.int16)
    return Trace(experts, {"model": "tiny", "num_experts": 5, "top_k": 2, "n_moe_layers": 2})


def test_trace_counts_every_selection(tmp_path):
    path = save_trace(tiny_trace(), tmp_path / "t.npz")
    result = load_counts(path)
    assert result.kind == "trace"
    np.testing.assert_array_equal(result.counts, [[3, 1, 1, 1, 0], [0, 1, 3, 2, 0]])
    first = load_counts(path, tokens=slice(0, 1))
    np.testing.assert_array_equal(first.counts, [[1, 1, 0, 0, 0], [0, 0, 1, 1, 0]])
    with pytest.raises(ValueError, match="selects no tokens"):
        trace_counts(tiny_trace(), slice(5, 9))


def test_popularity_json_and_own_report_round_trip(tmp_path):
    pop = tmp_path / "pop.json"
    pop.write_text(json.dumps({"total_input_tokens": 10, "expert_popularity": [[1, 2], [3, 0]]}))
    result = load_counts(pop)
    np.testing.assert_array_equal(result.counts, [[1, 2], [3, 0]])
    assert result.meta["total_input_tokens"] == 10
    report = tmp_path / "report.json"
    assert main(["imatrix", str(pop), "--slots", "2", "--json", str(report)]) == 0
    np.testing.assert_array_equal(load_counts(report).counts, [[1, 2], [3, 0]])


def test_shared_mixtral_popularity():
    path = shared_trace("mixtral-popularity/mixtral_8x7b_original-international_law.json")
    result = load_counts(path)
    assert result.counts.shape == (32, 8)
    # top-2 routing: every layer saw the same number of selections
    assert len(set(result.counts.sum(axis=1).tolist())) == 1


def test_npy_counts_and_bad_tables(tmp_path):
    good = tmp_path / "c.npy"
    np.save(good, COUNTS.astype(np.float32))
    np.testing.assert_array_equal(load_counts(good).counts, COUNTS)
    for name, bad, match in [("neg.npy", -COUNTS, "negative"), ("flat.npy", COUNTS[0], "2-D"),
                             ("frac.npy", COUNTS + 0.5, "whole numbers")]:
        np.save(tmp_path / name, bad)
        with pytest.raises(ValueError, match=match):
            load_counts(tmp_path / name)
    (tmp_path / "junk.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match="expert_popularity"):
        load_counts(tmp_path / "junk.json")


# -- CLI ------------------------------------------------------------------------------
def test_cli_json_schema_and_plan(tmp_path, capsys):
    gg = write_imatrix(tmp_path / "imatrix.gguf")
    out = tmp_path / "report.json"
    assert main(["imatrix", str(gg), "--slots", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["layers"] == 3 and report["experts"] == 6
    assert report["counts"] == COUNTS.tolist()
    layer0 = report["coverage"][0]
    # layer 0 shares: 0.5, 0.3125, 0.125, 0.0625 -> 1 expert for 50%, 3 for 90%
    assert layer0 == {**layer0, "layer": 0, "top1_share": 0.5, "experts_for_50": 1,
                      "experts_for_90": 3, "unused": 2, "hot": [0, 2, 3, 5]}
    # highest shares overall: (1,3)=0.75, (0,0)=0.5, (0,2)=0.3125, (2,4)=0.2 > (1,4)=0.1875
    assert report["plan"] == [[1, 3], [0, 0], [0, 2], [2, 4]]
    text = capsys.readouterr().out
    assert "plan: 4 of 4 slots" in text


def test_cli_fraction_and_plot(tmp_path):
    gg = write_imatrix(tmp_path / "imatrix.gguf")
    png = tmp_path / "cov.png"
    assert main(["imatrix", str(gg), "--fraction", "0.5", "--plot", str(png), "--json", "-"]) == 0
    pixels(png, (1430, 550))  # figsize 13 x 5 inches at 110 dpi: curves and heatmap, not blank


def test_cli_errors_are_one_line(tmp_path, capsys):
    dat = write_legacy_dat(tmp_path / "imatrix.dat", [("blk.0.ffn_up_exps.weight", 1, [1.0])], 1, "d")
    assert main(["imatrix", str(dat)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot rank experts" in err
    assert main(["imatrix", str(write_imatrix(tmp_path / "i.gguf")), "--fraction", "1.5"]) == 2
    assert "fraction must be between 0 and 1" in capsys.readouterr().err
