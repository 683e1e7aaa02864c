"""ggufmodel/reader.py equals gguf-py's GGUFReader, and the loader's config equals transformers'.

The fast reader replaces GGUFReader for the header (it parsed the vocabulary element by
element: ~12 s a read on a real model); ``loaders/gguf.py`` hands transformers' config
mapping a metadata-only copy instead of the whole file. Both must give what the slow path
gave, field for field; a truncated or corrupt header must say so.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from expertcache.ggufmodel.header import VOCAB_ARRAYS, read_header
from expertcache.ggufmodel.reader import read_gguf, write_metadata_only
from gguf_models import write_gguf

REAL_GGUF = Path(os.environ.get("EXPERTCACHE_REAL_GGUF", "/work/refs/cpu-model/model-Q4_K_M.gguf"))
FAMILIES = {"qwen3_moe": "Q4_K", "qwen2_moe": "Q8_0", "gpt_oss": "MXFP4"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_file(request, tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp(request.param) / "m.gguf", request.param, FAMILIES[request.param])


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    return write_vocab_gguf(tmp_path_factory.mktemp("vocab") / "vocab.gguf")


def write_vocab_gguf(path: Path, tokens: int = 5000) -> Path:
    """A file with a real-sized-in-kind vocabulary (tokens, types, scores, merges), every scalar
    type, a nested array, a non-UTF-8 string, a custom alignment and tensors of several types."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_custom_alignment(64)
    vocab = [f"tok{i}" if i % 7 else f"Ġ語{i}✓" for i in range(tokens)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([1 + i % 5 for i in range(tokens)])
    writer.add_token_scores([float(-i) / 3 for i in range(tokens)])
    writer.add_token_merges([f"t ok{i}" for i in range(tokens // 2)])
    writer.add_bos_token_id(1)
    for name, vtype, value in [("u8", GGUFValueType.UINT8, 200), ("i8", GGUFValueType.INT8, -5),
                               ("u16", GGUFValueType.UINT16, 60000), ("i16", GGUFValueType.INT16, -300),
                               ("u32", GGUFValueType.UINT32, 4_000_000_000), ("i32", GGUFValueType.INT32, -7),
                               ("f32", GGUFValueType.FLOAT32, 1e-6), ("b", GGUFValueType.BOOL, True),
                               ("u64", GGUFValueType.UINT64, 2**63 + 5), ("i64", GGUFValueType.INT64, -2**40),
                               ("f64", GGUFValueType.FLOAT64, 0.1)]:
        writer.add_key_value(f"test.{name}", value, vtype)
    writer.add_array("test.nested", [[1, 2], [3], [4, 5, 6]])
    writer.add_array("test.floats", [0.5, 1e-3, 3.25])
    writer.add_key_value("test.u16s", [1, 2, 65535], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT16)
    writer.add_key_value("test.not_utf8", b"\xff\xfe", GGUFValueType.STRING)
    writer.add_string("test.text", "héllo ✓")
    writer.add_tensor("a.weight", rng.standard_normal((4, 32)).astype(np.float32))
    writer.add_tensor("b.weight", rng.standard_normal((3, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("c.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("d.bias", np.arange(5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_raw_gguf(path: Path, entries: list[bytes], tensor_count: int = 0, tail: bytes = b"") -> Path:
    """A GGUF v3 from hand-packed KV entries: for what GGUFWriter cannot write (empty arrays)."""
    path.write_bytes(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, tensor_count, len(entries)) + b"".join(entries)
                     + tail)
    return path


def kv(key: str, vtype: GGUFValueType, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload


def array(itype: GGUFValueType, count: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IQ", itype, count) + payload


def assert_same_as_gguf_py(path: Path, skip=()) -> None:
    """Every field (name, types, contents()) and tensor (name, shape, type, offset, bytes) equal."""
    fast, slow = read_gguf(path, skip=skip), gguf.GGUFReader(path)
    assert list(fast.fields) == list(slow.fields)
    for name, field in slow.fields.items():
        ours = fast.fields[name]
        assert ours.types == tuple(field.types), name
        if name in skip:
            assert ours.value is None and ours.count == len(field.data)
            continue
        try:
            expected = field.contents()
        except ValueError:  # not UTF-8: header.py's metadata has None there
            expected = None
        assert ours.value == expected, name
        assert type(ours.value) is type(expected), name
        if isinstance(expected, list):
            assert [type(v) for v in ours.value] == [type(v) for v in expected], name
    assert [(t.name, tuple(int(d) for d in t.shape), t.tensor_type, t.data_offset, t.n_bytes) for t in slow.tensors] \
        == [(t.name, t.shape, t.tensor_type, t.data_offset, t.n_bytes) for t in fast.tensors]
    assert (fast.alignment, fast.data_start) == (slow.alignment, slow.data_offset)


def test_reader_equals_gguf_py_on_the_families(family_file):
    assert_same_as_gguf_py(family_file)
    assert_same_as_gguf_py(family_file, skip=VOCAB_ARRAYS)


def test_reader_equals_gguf_py_with_a_vocabulary(vocab_file):
    fast = read_gguf(vocab_file)
    assert fast.fields["tokenizer.ggml.tokens"].count == 5000 and fast.alignment == 64
    assert fast.fields["test.not_utf8"].value is None
    assert fast.fields["test.nested"].types == (GGUFValueType.ARRAY, GGUFValueType.ARRAY, GGUFValueType.INT32)
    assert_same_as_gguf_py(vocab_file)
    assert_same_as_gguf_py(vocab_file, skip=VOCAB_ARRAYS)


def test_reader_equals_gguf_py_on_empty_arrays(tmp_path):
    """GGUFReader records no element type for an empty array (and never checks it)."""
    arch = kv("general.architecture", GGUFValueType.STRING, struct.pack("<Q", 8) + b"qwen3moe")
    path = write_raw_gguf(tmp_path / "empty.gguf", [
        arch, kv("a.empty", GGUFValueType.ARRAY, array(GGUFValueType.INT32, 0)),
        kv("a.empty_strings", GGUFValueType.ARRAY, array(GGUFValueType.STRING, 0)),
        kv("a.bad_but_empty", GGUFValueType.ARRAY, array(99, 0)),
        kv("a.empty_first", GGUFValueType.ARRAY,
           array(GGUFValueType.ARRAY, 2, array(GGUFValueType.UINT8, 0) + array(GGUFValueType.UINT8, 2, b"\x01\x02")))])
    assert read_gguf(path).fields["a.empty_first"].value == [1, 2]
    assert_same_as_gguf_py(path)


def test_header_metadata_is_gguf_py_contents(family_file):
    """header.py's metadata dict is what it was with GGUFReader: contents() of every field but
    the vocabulary, and the TensorRefs' offsets and sizes are GGUFReader's."""
    header = read_header(family_file)
    slow = gguf.GGUFReader(family_file)
    assert header.metadata == {name: f.contents() for name, f in slow.fields.items() if name not in VOCAB_ARRAYS}
    assert list(header.metadata) == [name for name in slow.fields if name not in VOCAB_ARRAYS]
    for t in slow.tensors:
        ref = header.tensors[t.name]
        assert (ref.offset, ref.nbytes, ref.shape) == (t.data_offset, t.n_bytes, tuple(int(d) for d in t.shape[::-1]))


def test_metadata_copy_keeps_every_value_and_type(vocab_file, tmp_path):
    source = read_gguf(vocab_file)
    copy = write_metadata_only(source, tmp_path / "meta.gguf", drop=VOCAB_ARRAYS, extra_uint32={"x.count": 7})
    slow = gguf.GGUFReader(copy)
    assert len(slow.tensors) == 0
    kept = [n for n in source.fields if n not in VOCAB_ARRAYS and not n.startswith("GGUF.")]
    assert [n for n in slow.fields if not n.startswith("GGUF.")] == kept + ["x.count"]
    original = gguf.GGUFReader(vocab_file)
    for name in kept:
        assert slow.fields[name].types == original.fields[name].types, name
        assert [p.tobytes() for p in slow.fields[name].parts] == [p.tobytes() for p in original.fields[name].parts]
    assert slow.fields["x.count"].contents() == 7 and slow.fields["x.count"].types == [GGUFValueType.UINT32]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_hf_config_equals_transformers_on_the_original(family, tmp_path, monkeypatch):
    """transformers' mapping on the metadata-only copy equals its mapping on the file; so does the
    whole config _hf_config builds with either."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from expertcache.loaders import gguf as loader

    path = write_gguf(tmp_path / "m.gguf", family, FAMILIES[family])
    original = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    assert original.get("vocab_size") and original["tie_word_embeddings"] is False
    fast = loader.transformers_config(path)
    assert fast == {k: v for k, v in original.items() if k != "tie_word_embeddings"}
    header = read_header(path)
    ours = loader._hf_config(header).to_dict()
    monkeypatch.setattr(loader, "transformers_config", lambda p: dict(
        load_gguf_checkpoint(str(p), return_tensors=False)["config"]))
    assert ours == loader._hf_config(header).to_dict()


def test_hf_config_keeps_a_stated_vocab_size(tmp_path):
    """A file that states {arch}.vocab_size keeps it; no stand-in is added."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from expertcache.loaders.gguf import transformers_config

    writer = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "qwen3moe")
    writer.add_vocab_size(300)
    writer.add_token_list([f"t{i}" for i in range(200)])
    writer.add_block_count(2)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    config = transformers_config(tmp_path / "v.gguf")
    assert config["vocab_size"] == 300 == load_gguf_checkpoint(str(tmp_path / "v.gguf"))["config"]["vocab_size"]


def test_tokenizer_equals_autotokenizer_on_the_file(tmp_path):
    """load_gguf_tokenizer names the model type instead of letting AutoTokenizer build the config:
    the same class and the same tokenizer."""
    from transformers import AutoTokenizer

    from expertcache.loaders.gguf import load_gguf_tokenizer

    path = write_gguf(tmp_path / "m.gguf", "qwen3_moe", "Q8_0")
    ref, ours = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), load_gguf_tokenizer(path)
    text = "the cat <|im_start|>user\nhello ✓"
    assert type(ours) is type(ref)
    assert ours(text).input_ids == ref(text).input_ids
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.special_tokens_map == ref.special_tokens_map and ours.init_kwargs == ref.init_kwargs


# -- truncated and corrupt headers: one clear ValueError -----------------------------------
def _cut(path: Path, at: int) -> Path:
    path.write_bytes(path.read_bytes()[:at])
    return path


def test_truncated_inside_the_kv_section(vocab_file, tmp_path):
    spans = {name: f.span for name, f in read_gguf(vocab_file).fields.items()}
    data = vocab_file.read_bytes()
    start, end = spans["tokenizer.ggml.tokens"]
    for at, what in [((start + end) // 2, "the 5000 values of metadata 'tokenizer.ggml.tokens'"),
                     (spans["test.f64"][1] - 3, "the value of metadata 'test.f64'"),
                     (spans["test.u8"][0] + 5, "metadata key"),
                     # past the key's length and text and the value type: inside the array header
                     (spans["tokenizer.ggml.merges"][0] + 8 + 21 + 4 + 5,
                      "the array header of metadata 'tokenizer.ggml.merges'"),
                     (20, "the GGUF header's counts"), (6, "the GGUF magic and version")]:
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:at])
        with pytest.raises(ValueError, match="truncated or corrupt GGUF header: .*download the file again") as err:
            read_gguf(path)
        assert what in str(err.value)
        with pytest.raises(ValueError, match="truncated"):
            read_header(path)


def test_truncated_inside_the_tensor_infos(vocab_file, tmp_path):
    source = read_gguf(vocab_file)
    infos = max(f.span[1] for f in source.fields.values() if f.span)  # the tensor infos follow the KVs
    # each: name (length + text), dimension count, dimensions, type, offset
    end = infos + sum(8 + len(t.name) + 4 + 8 * len(t.shape) + 4 + 8 for t in source.tensors)
    data = vocab_file.read_bytes()
    for at, what in [(infos + 4, "the length of the name of tensor info 1 of 4"),
                     (infos + 8 + len("a.weight") + 6, "the 2 dimensions of tensor 'a.weight'"),
                     (end - 5, "the type and offset of tensor 'd.bias'")]:
        path = tmp_path / "cut.gguf"
        path.write_bytes(data[:at])
        with pytest.raises(ValueError, match="truncated or corrupt GGUF header") as err:
            read_gguf(path)
        assert what in str(err.value)


def test_truncated_family_file_through_read_header(family_file, tmp_path):
    data = family_file.read_bytes()
    infos = max(f.span[1] for f in read_gguf(family_file).fields.values() if f.span)
    path = tmp_path / "cut.gguf"
    for at in (100, infos - 10, infos + 50, len(data) - 1000):
        path.write_bytes(data[:at])
        with pytest.raises(ValueError, match="truncated"):
            read_header(path)


def test_corrupt_headers(tmp_path):
    arch = kv("general.architecture", GGUFValueType.STRING, struct.pack("<Q", 8) + b"qwen3moe")
    cases = {
        "metadata 'x' has value type 42, which GGUF does not define": [arch, kv("x", 42, b"")],
        "metadata key 'general.architecture' appears twice": [arch, arch],
        "general.alignment is 48, not a power of two": [kv("general.alignment", GGUFValueType.UINT32,
                                                           struct.pack("<I", 48))],
        "general.alignment is of type UINT64": [kv("general.alignment", GGUFValueType.UINT64, struct.pack("<Q", 32))],
        "metadata key 1 is not UTF-8": [struct.pack("<Q", 2) + b"\xff\xfe" + struct.pack("<I", 4) + b"\0" * 4],
    }
    for message, entries in cases.items():
        with pytest.raises(ValueError, match=f"corrupt GGUF header: {message}.*download the file again"):
            read_gguf(write_raw_gguf(tmp_path / "bad.gguf", entries))

    def tensor(name: bytes, dims: tuple, ggml_type: int) -> bytes:
        return (struct.pack("<Q", len(name)) + name + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
                + struct.pack("<IQ", ggml_type, 0))
    for message, tensors in {"ggml type 250, which gguf-py does not know": [tensor(b"t", (32,), 250)],
                             "tensor 't' appears twice": [tensor(b"t", (32,), 0), tensor(b"t", (32,), 0)],
                             "rows of 40 values, not a multiple of its block of 32": [tensor(b"t", (40, 2), 8)]
                             }.items():
        path = write_raw_gguf(tmp_path / "bad.gguf", [arch], len(tensors), b"".join(tensors) + b"\0" * 4096)
        with pytest.raises(ValueError, match=f"corrupt GGUF header: .*{message}"):
            read_gguf(path)


def test_not_gguf_and_other_versions(tmp_path):
    zipped = tmp_path / "zip.gguf"
    zipped.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ValueError, match="not a GGUF file .*b'PK"):
        read_gguf(zipped)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(empty)
    v1 = tmp_path / "v1.gguf"  # left to gguf-py, which refuses v1 itself
    v1.write_bytes(struct.pack("<IIII", gguf.GGUF_MAGIC, 1, 0, 0))
    with pytest.raises(ValueError, match="not a readable GGUF file .*version 1"):
        read_gguf(v1)


def test_big_endian_file_is_read_by_gguf_py(tmp_path):
    """Big-endian files go to GGUFReader; the result has the same shape, without byte spans."""
    writer = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "qwen3moe", endianess=gguf.GGUFEndian.BIG)
    writer.add_block_count(3)
    writer.add_tensor("a.weight", np.arange(32, dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    fast = read_gguf(tmp_path / "be.gguf")
    assert not fast.raw and fast.version == 3 and fast.fields["qwen3moe.block_count"].value == 3
    assert [(t.name, t.shape) for t in fast.tensors] == [("a.weight", (32,))]
    with pytest.raises(ValueError, match="no byte spans"):
        write_metadata_only(fast, tmp_path / "copy.gguf")


@pytest.mark.slow
@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"no real model at {REAL_GGUF} (set EXPERTCACHE_REAL_GGUF "
                    "to a .gguf to compare the readers on it; GGUFReader takes ~12 s there)")
def test_reader_equals_gguf_py_on_a_real_model():
    assert_same_as_gguf_py(REAL_GGUF)
