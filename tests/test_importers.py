"""Importers: route_trace v1 CSV and JSONL, on small hand-written files and the shared phone CSV."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import shared_trace  # tests/ is on sys.path (not a package)
from expertcache.trace import TraceError, load_trace, save_trace
from expertcache.trace.importers import import_jsonl, import_route_csv, import_trace

HEADER = """# route_trace v1
# model=/data/tiny-Q4.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2
# layer=0 expert_bytes=100 dense_bytes=7
# layer=1 expert_bytes=120 dense_bytes=7
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
"""


def rows_for(step, phase, layers=(0, 1), picks=((0, 1), (2, 3))):
    out = []
    for layer in layers:
        for slot, expert in enumerate(picks[layer]):
            out.append(f"0,{phase},{step},{layer},{slot},{expert},{0.6 - 0.2 * slot},0,0")
    return out


def write_csv(tmp_path, rows, header=HEADER):
    path = tmp_path / "r.route.csv"
    path.write_text(header + "\n".join(rows) + "\n")
    return path


def test_csv_small_file(tmp_path):
    # step 0: prompt token missing layer 1 (llama.cpp skips it): incomplete, dropped
    rows = rows_for(0, 0, layers=(0,)) + rows_for(1, 0) + rows_for(2, 1, picks=((3, 0), (1, 2)))
    result = import_route_csv(write_csv(tmp_path, rows))
    trace = result.trace
    assert result.dropped == 1 and trace.meta["dropped_tokens"] == 1 and result.records == 10
    assert trace.experts.shape == (2, 2, 2)
    assert trace.experts[:, 0].tolist() == [[0, 1], [2, 3]]
    assert trace.experts[:, 1].tolist() == [[3, 0], [1, 2]]  # rank order from the slot column
    assert trace.phase.tolist() == [0, 1]
    assert np.allclose(trace.weights[0, 0], [0.6, 0.4], atol=1e-3)
    assert trace.meta["model"] == "tiny-Q4" and trace.meta["arch"] == "qwen3moe"
    assert trace.meta["expert_bytes"] == 120  # the largest: one slot must hold any expert
    assert trace.meta["expert_bytes_per_layer"] == [100, 120]


def test_csv_rows_out_of_order_are_ranked_by_slot(tmp_path):
    rows = rows_for(0, 1)
    rows[0], rows[1] = rows[1], rows[0]
    trace = import_route_csv(write_csv(tmp_path, rows)).trace
    assert trace.experts[0, 0].tolist() == [0, 1]


@pytest.mark.parametrize("row,message", [
    ("0,1,5,0,0,9,0.5,0,0", "r.route.csv:6: expert 9 outside 0..3"),
    ("0,1,5,2,0,1,0.5,0,0", ":6: layer 2 outside 0..1"),
    ("0,1,5,0,2,1,0.5,0,0", ":6: rank 2 outside 0..1"),
    ("0,3,5,0,0,1,0.5,0,0", ":6: phase 3 must be 0 (prompt) or 1"),
    ("0,1,x,0,0,1,0.5,0,0", ":6: turn,phase,step,layer,slot,expert must be integers"),
    ("0,1,5,0,0,1,heavy,0,0", ":6: weight 'heavy' is not a number"),
    ("0,1,5,0,0,1", ":6: 6 fields, the header names 9"),
])
def test_csv_bad_rows_name_the_line(tmp_path, row, message):
    with pytest.raises(TraceError, match=re.escape(message)):
        import_route_csv(write_csv(tmp_path, [row]))


def test_csv_duplicate_and_inconsistent_phase(tmp_path):
    rows = rows_for(0, 1)
    with pytest.raises(TraceError, match=r":10: token \(0, 0\) layer 0 rank 0 already given on line 6"):
        import_route_csv(write_csv(tmp_path, rows + [rows[0]]))
    bad = rows_for(0, 1)
    bad[3] = bad[3].replace("0,1,0,", "0,0,0,", 1)
    with pytest.raises(TraceError, match=":9: token .* has phase 0 here but 1 on an earlier line"):
        import_route_csv(write_csv(tmp_path, bad))


def test_csv_repeated_expert_in_a_token(tmp_path):
    rows = rows_for(0, 1, picks=((1, 1), (2, 3)))
    with pytest.raises(TraceError, match="selects the same expert twice at layer 0"):
        import_route_csv(write_csv(tmp_path, rows))


def test_csv_header_problems(tmp_path):
    with pytest.raises(TraceError, match="header lacks n_expert=N"):
        import_route_csv(write_csv(tmp_path, rows_for(0, 1), HEADER.replace(" n_expert=4", "")))
    with pytest.raises(TraceError, match="unsupported 'route_trace v2'"):
        import_route_csv(write_csv(tmp_path, rows_for(0, 1), HEADER.replace("v1", "v2")))
    with pytest.raises(TraceError, match=":5: column header lacks slot, expert"):
        import_route_csv(write_csv(tmp_path, [], HEADER.replace(",slot,expert", "")))
    with pytest.raises(TraceError, match="no column header line"):
        import_route_csv(write_csv(tmp_path, [], HEADER.rsplit("turn", 1)[0]))
    with pytest.raises(TraceError, match="no token covers all 2 layers x top_k 2"):
        import_route_csv(write_csv(tmp_path, rows_for(0, 0, layers=(0,))))


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown trace format 'parquet'; use one of route-csv, jsonl"):
        import_trace(tmp_path / "x", "parquet")
    with pytest.raises(FileNotFoundError, match="input file not found"):
        import_trace(tmp_path / "absent.csv", "route-csv")


def test_shared_phone_csv():
    path = shared_trace("qwen3-30b-a3b-top6-phone.route.csv")
    result = import_trace(path, "route-csv")
    trace = result.trace
    # 28 prompt tokens of which 27 lack layer 47, then 128 generated tokens
    assert result.dropped == 27 and trace.num_tokens == 129
    assert (trace.num_layers, trace.top_k, trace.num_experts) == (48, 6, 128)
    assert int((trace.phases == 0).sum()) == 1 and int((trace.phases == 1).sum()) == 128
    per_layer = trace.meta["expert_bytes_per_layer"]
    assert set(per_layer) == {3059712, 2654208} and trace.meta["expert_bytes"] == 3059712
    assert trace.weights is not None and np.all(trace.weights[:, :, 0] >= trace.weights[:, :, 1])


# -- JSONL --------------------------------------------------------------------

def write_jsonl(tmp_path, records):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_small_file(tmp_path, capsys):
    recs = [{"meta": {"num_experts": 6, "model": "toy"}}]
    for t in (2, 0, 1):  # tokens out of order are sorted by token_idx
        for layer in (0, 1):
            recs.append({"layer": layer, "token_idx": t, "experts": [t, t + layer + 1],
                         "weights": [0.7, 0.3], "phase": 0 if t == 0 else 1})
    recs.append({"layer": 0, "token_idx": 3, "experts": [5, 4], "weights": [0.5, 0.5]})  # no layer 1
    result = import_jsonl(write_jsonl(tmp_path, recs))
    trace = result.trace
    assert result.dropped == 1 and result.records == 7
    assert trace.experts[:, :, 0].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert trace.experts[1, 2].tolist() == [2, 4]
    assert trace.phase.tolist() == [0, 1, 1] and trace.num_experts == 6
    assert trace.meta["model"] == "toy" and "num_experts_inferred" not in trace.meta


def test_jsonl_infers_num_experts_and_defaults_phase(tmp_path):
    recs = [{"layer": 0, "token_idx": t, "experts": [t, t + 2]} for t in range(3)]
    trace = import_jsonl(write_jsonl(tmp_path, recs)).trace
    assert trace.num_experts == 5 and trace.meta["num_experts_inferred"] is True
    assert trace.phase.tolist() == [1, 1, 1] and trace.weights is None
    assert import_jsonl(write_jsonl(tmp_path, recs), num_experts=16).trace.num_experts == 16


@pytest.mark.parametrize("record,message", [
    ('{"layer": 0, "token_idx": 1, "experts": [1, 2]', r"r.jsonl:2: not valid JSON"),
    ("[1, 2]", r":2: a record must be a JSON object, got list"),
    ({"layer": 0, "experts": [1, 2]}, r":2: record lacks token_idx"),
    ({"layer": -1, "token_idx": 1, "experts": [1, 2]}, r":2: 'layer' must be a whole number >= 0"),
    ({"layer": 0, "token_idx": 1.5, "experts": [1, 2]}, r":2: 'token_idx' must be a whole number"),
    ({"layer": 0, "token_idx": 1, "experts": [1, "a"]}, r":2: 'experts' must be a non-empty list"),
    ({"layer": 0, "token_idx": 1, "experts": [1, 1]}, r":2: 'experts' repeats an id"),
    ({"layer": 0, "token_idx": 1, "experts": [1, 2, 3]}, r":2: 3 experts, but line 1 has 2"),
    ({"layer": 0, "token_idx": 1, "experts": [1, 2], "phase": 2}, r":2: 'phase' must be 0"),
    ({"layer": 0, "token_idx": 1, "experts": [1, 2], "weights": [1]}, r":2: 'weights' must be a list of 2"),
    ({"layer": 0, "token_idx": 1, "experts": [1, 9]}, r":2: expert 9 outside 0..7"),
    ({"layer": 0, "token_idx": 0, "experts": [3, 4]}, r":2: token 0 layer 0 rank 0 already given on line 1"),
])
def test_jsonl_bad_records_name_the_line(tmp_path, record, message):
    first = {"layer": 0, "token_idx": 0, "experts": [1, 2]}
    with pytest.raises(TraceError, match=re.escape(message)):
        import_jsonl(write_jsonl(tmp_path, [first, record]), num_experts=8)


def test_jsonl_weights_on_some_records_only(tmp_path):
    recs = [{"layer": 0, "token_idx": 0, "experts": [1, 2], "weights": [0.5, 0.5]},
            {"layer": 0, "token_idx": 1, "experts": [1, 2]}]
    with pytest.raises(TraceError, match=":2: 'weights' must be on every record or on none"):
        import_jsonl(write_jsonl(tmp_path, recs))


def test_jsonl_empty(tmp_path):
    with pytest.raises(TraceError, match="no routing records"):
        import_jsonl(write_jsonl(tmp_path, [{"meta": {"num_experts": 4}}]))


def test_imported_trace_round_trips(tmp_path):
    rows = rows_for(0, 0) + rows_for(1, 1, picks=((2, 3), (0, 1)))
    trace = import_route_csv(write_csv(tmp_path, rows)).trace
    back = load_trace(save_trace(trace, tmp_path / "out.npz"))
    assert np.array_equal(back.experts, trace.experts) and back.meta == trace.meta
