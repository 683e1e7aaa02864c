"""Trace format: the shared traces load as they are; every broken file gets a precise TraceError."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from expertcache.trace import Trace, TraceError, load_trace, save_trace

from conftest import shared_trace  # tests/ is on sys.path (not a package)

META = {"model": "tiny", "num_experts": 4, "top_k": 2, "n_moe_layers": 2}


def experts() -> np.ndarray:
    ex = np.zeros((2, 3, 2), dtype=np.int16)  # L=2 layers, T=3 tokens, K=2
    ex[..., 1] = np.array([1, 2, 3])
    return ex


def write(tmp_path, name="t.npz", **arrays) -> str:
    arrays.setdefault("experts", experts())
    arrays.setdefault("meta", np.array(json.dumps(META)))
    path = tmp_path / name
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return str(path)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-code.npz", "qwen3-30b-a3b-general.npz"])
def test_shared_traces_load_as_they_are(name):
    trace = load_trace(shared_trace(name))
    assert (trace.num_layers, trace.num_tokens, trace.top_k, trace.num_experts) == (48, 8000, 8, 128)
    assert trace.experts.dtype == np.int16 and trace.phase is None
    assert (trace.phases == 1).all()  # absent phase means all generation
    assert trace.meta["n_moe_layers"] == 48  # filled in from the array's shape


def test_round_trip_keeps_every_array(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.random((2, 3, 2)).astype(np.float16)
    trace = Trace(experts(), dict(META, expert_bytes=1000), w, np.array([0, 1, 1], np.uint8))
    back = load_trace(save_trace(trace, tmp_path / "rt.npz"))
    assert np.array_equal(back.experts, trace.experts) and np.array_equal(back.weights, w)
    assert back.phase.tolist() == [0, 1, 1] and back.meta == trace.meta
    head = back.slice_tokens(2)  # cuts tokens (axis 1) of experts and weights alike
    assert head.num_tokens == 2 and np.array_equal(head.weights, w[:, :2])
    assert head.phase.tolist() == [0, 1]
    assert not (tmp_path / "rt.npz.tmp").exists()


def check(path, *fragments):
    with pytest.raises(TraceError) as err:
        load_trace(path)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    assert str(path) in str(err.value)  # the message names the file


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_trace(tmp_path / "absent.npz")


def test_truncated_file(tmp_path):
    good = write(tmp_path, "good.npz")
    data = open(good, "rb").read()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(data[: len(data) // 2])
    check(cut, "truncated .npz")


def test_damaged_member(tmp_path):
    path = tmp_path / "damaged.npz"
    np.savez_compressed(path, experts=np.arange(4000, dtype=np.int16).reshape(2, 1000, 2) % 4,
                        meta=np.array(json.dumps(dict(META))))
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as zf:  # flip bytes inside the experts member's compressed data
        info = zf.getinfo("experts.npy")
    start = info.header_offset + 30 + len(info.filename) + 20
    data[start:start + 40] = bytes(40)
    path.write_bytes(bytes(data))
    check(path, "corrupt .npz trace")


def test_not_a_zip(tmp_path):
    path = tmp_path / "text.npz"
    path.write_text("turn,phase,step\n")
    check(path, "not a .npz archive")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.npz"
    path.write_bytes(b"")
    check(path, "empty (0 bytes)")


def test_single_npy_is_not_an_archive(tmp_path):
    path = tmp_path / "one.npz"
    with open(path, "wb") as fh:
        np.save(fh, experts())
    check(path, "single .npy array")


def test_missing_experts(tmp_path):
    check(write(tmp_path, experts=None, weights=np.zeros((2, 3, 2))), "no 'experts' array", "weights")


def test_object_array(tmp_path):
    check(write(tmp_path, experts=np.array([{"a": 1}], dtype=object)), "'experts' holds Python objects")


@pytest.mark.parametrize("shape", [(6,), (2, 6), (1, 2, 3, 2)])
def test_wrong_ndim(tmp_path, shape):
    check(write(tmp_path, experts=np.zeros(shape, np.int16)), "must be a 3-D array", str(shape))


def test_wrong_dtype(tmp_path):
    check(write(tmp_path, experts=experts().astype(np.float32)), "must hold integers", "float32")


def test_ids_do_not_fit_int16(tmp_path):
    check(write(tmp_path, experts=experts().astype(np.int64) + 70000), "do not fit int16")


@pytest.mark.parametrize("bad,where", [(4, "layer 1, token 2"), (-1, "layer 1, token 2")])
def test_ids_out_of_range(tmp_path, bad, where):
    ex = experts()
    ex[1, 2, 0] = bad
    check(write(tmp_path, experts=ex), f"expert id {bad}", where, "outside 0..3")


def test_bad_meta_json(tmp_path):
    check(write(tmp_path, meta=np.array("{num_experts: 4")), "'meta' is not valid JSON")


def test_meta_not_an_object(tmp_path):
    check(write(tmp_path, meta=np.array("[4, 2]")), "'meta' must be a JSON object")


def test_missing_meta(tmp_path):
    check(write(tmp_path, meta=None), "no 'meta' JSON string")


def test_meta_lacks_num_experts(tmp_path):
    check(write(tmp_path, meta=np.array(json.dumps({"model": "x"}))), "meta lacks num_experts")


def test_meta_not_positive_integer(tmp_path):
    check(write(tmp_path, meta=np.array(json.dumps(dict(META, num_experts="4")))),
          "meta['num_experts'] must be a positive integer", "'4'")


@pytest.mark.parametrize("key,value,message", [
    ("n_moe_layers", 3, "n_moe_layers=3 but 'experts' has 2 layers"),
    ("top_k", 4, "top_k=4 but 'experts' has 2 per token"),
])
def test_meta_shape_mismatch(tmp_path, key, value, message):
    check(write(tmp_path, meta=np.array(json.dumps(dict(META, **{key: value})))), message)


def test_top_k_above_num_experts(tmp_path):
    meta = dict(META, num_experts=1)
    check(write(tmp_path, experts=np.zeros((2, 3, 2), np.int16), meta=np.array(json.dumps(meta))),
          "top_k=2 exceeds num_experts=1")


def test_bad_expert_bytes(tmp_path):
    check(write(tmp_path, meta=np.array(json.dumps(dict(META, expert_bytes=-5)))),
          "meta['expert_bytes'] must be a positive integer or absent")


def test_bad_weights_shape(tmp_path):
    check(write(tmp_path, weights=np.zeros((2, 3, 3), np.float16)),
          "'weights' has shape (2, 3, 3), expected (2, 3, 2)")


def test_weights_not_numbers(tmp_path):
    check(write(tmp_path, weights=np.full((2, 3, 2), "a")), "'weights' must hold numbers")


def test_weights_not_finite(tmp_path):
    w = np.ones((2, 3, 2), np.float32)
    w[1, 0, 1] = np.nan
    check(write(tmp_path, weights=w), "non-finite value at layer 1, token 0, rank 1")


def test_bad_logits(tmp_path):
    E = META["num_experts"]
    check(write(tmp_path, logits=np.zeros((2, 3, 2), np.float16)),
          f"'logits' has shape (2, 3, 2), expected (2, 3, {E}) [layers, tokens, num_experts]")
    lg = np.zeros((2, 3, E), np.float32)
    lg[0, 2, 1] = np.inf
    check(write(tmp_path, logits=lg), "'logits' has a non-finite value at layer 0, token 2, expert 1")


def test_bad_phase_shape(tmp_path):
    check(write(tmp_path, phase=np.zeros(4, np.uint8)), "'phase' has shape (4,), expected (3,)")


def test_bad_phase_value(tmp_path):
    check(write(tmp_path, phase=np.array([0, 1, 2])), "0 (prompt) or 1 (generation)", "token 2 has 2")


def test_trace_constructor_validates():
    with pytest.raises(TraceError, match="n_moe_layers=5"):
        Trace(experts(), dict(META, n_moe_layers=5))


def test_every_trace_module_imports_without_torch():
    """trace/ is plain data: with torch made unimportable, all of it still loads (the
    recorder, which needs torch, lives in integrations/)."""
    import pkgutil
    import subprocess
    import sys

    import expertcache.trace as pkg

    names = [f"expertcache.trace.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)]
    assert "expertcache.trace.synth" in names and "expertcache.trace.format" in names
    code = ("import sys; sys.modules['torch'] = None; import importlib; "
            f"[importlib.import_module(n) for n in {names!r}]; "
            "from expertcache.trace import synth_trace; synth_trace('olmoe', 20); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
