"""A GGUF file's header read straight from its bytes: metadata, tensor infos, data offsets.

Torch-free (numpy and gguf's constants only). Why not gguf-py's ``GGUFReader``: it parses
every metadata value element by element, making a numpy memmap slice per element
(``_get_field_parts``), vocabulary included. On a 731 MiB Qwen3-MoE Q4_K_M file (151,936
tokens and as many token types) ``GGUFReader(path)`` took 10.7-11.7 s, nearly all of it the
vocabulary, and ``read_header`` built one on every load, ``plan`` and ``sim --model``. This
reader walks the same bytes with ``struct`` over an mmap: 0.13 s decoding every value,
0.06 s stepping over the vocabulary as ``header.py`` does (``read_header``: 10.7 s -> 0.06 s).
A Qwen3-30B-A3B file adds ~151k merges, which GGUFReader parses the same way.

What comes out matches ``GGUFReader`` (``tests/test_gguf_reader.py`` checks it field by field):

- ``fields``: name -> ``Field``, in file order, led by the three pseudo-fields GGUFReader adds
  (``GGUF.version``, ``GGUF.tensor_count``, ``GGUF.kv_count``). ``Field.types`` is
  ``ReaderField.types`` (``(ARRAY, STRING)`` for a string array, ``(ARRAY,)`` for an empty
  array, nested arrays ``(ARRAY, ARRAY, ...)``); ``Field.value`` is ``ReaderField.contents()``:
  a Python scalar, a str, or a flat list (nested arrays flattened, as ``contents()`` does),
  ``None`` where ``contents()`` fails (a string that is not UTF-8) or the caller skipped it.
- ``tensors``: ``TensorInfo`` with ``ReaderTensor``'s ``shape`` (GGUF order, innermost first),
  ``tensor_type``, ``data_offset`` (absolute) and ``n_bytes``.

Each field also keeps its entry's byte span in the file, so ``write_metadata_only`` can copy
the metadata to a small GGUF byte for byte (``loaders/gguf.py`` hands that to transformers).

Versions 2 and 3, little-endian, are read here (every file llama.cpp writes). Anything else
(a big-endian file, GGUF v1, a version newer than this reader) goes to ``GGUFReader``: it
handles byte-swapped files and refuses the versions it cannot read with its own message,
and such files are too rare to be worth a second code path here.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf.constants import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType,
                            GGUFValueType)

_VERSIONS = (2, 3)  # the versions GGUFReader reads too; v2 and v3 lay the header out the same
_PREAMBLE = struct.Struct("<IIQQ")  # magic, version, tensor count, KV count
# Little-endian struct format of each fixed-size value type, from the GGUF spec: gguf-py keeps
# its own tables private (GGUFWriter._simple_value_packing, GGUFReader.gguf_scalar_to_np). The
# same letters name the numpy dtypes of arrays.
_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_LENGTH = struct.Struct("<Q")
_AGAIN = "download the file again"


class Field(NamedTuple):
    """One metadata key/value, as GGUFReader's ``ReaderField`` has it."""

    name: str
    types: tuple[GGUFValueType, ...]
    value: Any  # ReaderField.contents(); None when skipped or not UTF-8
    count: int = 1  # elements of an array (of its first level), 1 otherwise
    span: tuple[int, int] | None = None  # the whole entry's bytes in the file (key, type, value)


class TensorInfo(NamedTuple):
    """One tensor's entry of the header, as GGUFReader's ``ReaderTensor`` has it."""

    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    tensor_type: GGMLQuantizationType
    data_offset: int  # absolute, in the file
    n_bytes: int


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file's header. ``raw``: read here, so the fields' ``span``s point into the file."""

    path: Path
    version: int
    fields: dict[str, Field]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_start: int
    raw: bool = True


class _Undecodable(Exception):
    """A string value that is not UTF-8: GGUFReader's contents() fails on it, so the value is None."""


class _Bytes:
    """The mapped file and a read position; every read checks the end of the file first."""

    __slots__ = ("data", "size", "pos", "path")

    def __init__(self, data, path: Path):
        self.data, self.size, self.pos, self.path = data, len(data), 0, path

    def take(self, n: int, what: str) -> int:
        """Step over ``n`` bytes; their start."""
        start = self.pos
        if start + n > self.size:
            raise _truncated(self.path, what, start, n, self.size)
        self.pos = start + n
        return start

    def unpack(self, fmt: struct.Struct, what: str) -> tuple:
        return fmt.unpack_from(self.data, self.take(fmt.size, what))

    def string(self, what: str) -> bytes:
        (n,) = self.unpack(_LENGTH, f"the length of {what}")
        start = self.take(n, what)
        return self.data[start:start + n]


def read_gguf(path: str | Path, skip: Collection[str] = ()) -> GgufFile:
    """Read ``path``'s header. ``skip``: keys whose array values are stepped over, not decoded
    (the vocabulary: ``Field.value`` None, ``count`` still set). A clear ValueError when the
    header is truncated or corrupt; OSError as the file system gives it."""
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        _check_magic(path, head)
        (version,) = struct.unpack_from("<I", head, 4)
        if version not in _VERSIONS:  # big-endian (the version reads as 0x0N000000 here), v1, newer
            return _read_with_gguf_py(path, skip)
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(_Bytes(data, path), skip)


def write_metadata_only(source: GgufFile, dest: str | Path, drop: Collection[str] = (),
                        extra_uint32: Mapping[str, int] | None = None) -> Path:
    """Write a GGUF at ``dest`` holding ``source``'s metadata, less the ``drop`` keys, plus
    ``extra_uint32`` keys, and no tensors.

    Kept entries are copied byte for byte from the file (key, value type and value), not
    re-encoded: every value keeps its exact type, including what gguf-py's GGUFWriter cannot
    write back (an empty array, the element types of nested arrays, a string that is not UTF-8).
    """
    if not source.raw:
        raise ValueError(f"{source.path}: read through gguf-py (not GGUF v2/v3 little-endian); "
                         "its metadata has no byte spans to copy")
    dest = Path(dest)
    spans = [f.span for f in source.fields.values() if f.span is not None and f.name not in drop]
    extra = dict(extra_uint32 or {})
    with open(source.path, "rb") as src, open(dest, "wb") as out:
        out.write(_PREAMBLE.pack(GGUF_MAGIC, source.version, 0, len(spans) + len(extra)))
        for start, end in spans:
            src.seek(start)
            out.write(src.read(end - start))
        for key, value in extra.items():
            encoded = key.encode("utf-8")
            out.write(_LENGTH.pack(len(encoded)) + encoded + struct.pack("<II", GGUFValueType.UINT32, value))
    return dest


def _check_magic(path: Path, head: bytes) -> None:
    magic = struct.pack("<I", GGUF_MAGIC)
    if head[:4] != magic[:len(head)]:
        raise ValueError(f"{path}: not a GGUF file (it starts with {head[:4]!r}, not the GGUF magic {magic!r}); "
                         "give a .gguf model file")
    if len(head) < 8:
        raise _truncated(path, "the GGUF magic and version", 0, 8, len(head))


def _parse(buf: _Bytes, skip: Collection[str]) -> GgufFile:
    _magic, version, tensor_count, kv_count = buf.unpack(_PREAMBLE, "the GGUF header's counts")
    # GGUFReader lists these three first, as fields: kept, so that metadata dicts built from
    # either reader are equal
    fields = {"GGUF.version": Field("GGUF.version", (GGUFValueType.UINT32,), version),
              "GGUF.tensor_count": Field("GGUF.tensor_count", (GGUFValueType.UINT64,), tensor_count),
              "GGUF.kv_count": Field("GGUF.kv_count", (GGUFValueType.UINT64,), kv_count)}
    for index in range(kv_count):
        field = _field(buf, index, kv_count, skip)
        if field.name in fields:
            raise _corrupt(buf.path, f"metadata key {field.name!r} appears twice")
        fields[field.name] = field
    entries = [_tensor_entry(buf, index, tensor_count) for index in range(tensor_count)]
    alignment = _alignment(buf.path, fields.get("general.alignment"))
    data_start = -(-buf.pos // alignment) * alignment  # the tensor data starts aligned
    tensors = _tensors(buf.path, entries, data_start)
    return GgufFile(buf.path, version, fields, tensors, alignment, data_start)


def _field(buf: _Bytes, index: int, total: int, skip: Collection[str]) -> Field:
    """One KV entry: key (string), value type (uint32), value."""
    start = buf.pos
    key = _text(buf.path, buf.string(f"metadata key {index + 1} of {total}"), f"metadata key {index + 1}")
    (raw,) = buf.unpack(_U32, f"the value type of metadata {key!r}")
    vtype = _value_type(buf.path, raw, key)
    keep = key not in skip
    count = 1
    try:
        if vtype == GGUFValueType.ARRAY:
            types, value, count = _array(buf, key, keep)
        elif vtype == GGUFValueType.STRING:
            types, value = (vtype,), _decoded(buf.string(f"the value of metadata {key!r}"))
        else:
            fmt = _STRUCTS[vtype]
            types, value = (vtype,), buf.unpack(fmt, f"the value of metadata {key!r}")[0]
    except _Undecodable as err:  # not UTF-8: contents() raises on it; the value is None
        types, value, count = err.args
    return Field(key, types, value if keep else None, count, (start, buf.pos))


def _array(buf: _Bytes, key: str, keep: bool) -> tuple[tuple[GGUFValueType, ...], list | None, int]:
    """An array value: (types as GGUFReader lists them, flat values, element count)."""
    raw, count = buf.unpack(_ARRAY_HEAD, f"the array header of metadata {key!r}")
    if count == 0:  # GGUFReader records no element type then (and never checks it)
        return (GGUFValueType.ARRAY,), [], 0
    itype = _value_type(buf.path, raw, key)
    what = f"the {count} values of metadata {key!r}"
    if itype in _STRUCTS:
        fmt = _STRUCTS[itype]
        start = buf.take(count * fmt.size, what)
        values = np.frombuffer(buf.data[start:buf.pos], np.dtype(fmt.format)).tolist() if keep else None
        return (GGUFValueType.ARRAY, itype), values, count
    if itype == GGUFValueType.STRING:
        values = _strings(buf, count, keep, what)
        return (GGUFValueType.ARRAY, itype), values, count
    # an array of arrays: contents() flattens it, and the types are those of its first element
    values, inner, undecodable = [] if keep else None, (), False
    for i in range(count):
        try:
            types, sub, _ = _array(buf, key, keep)
        except _Undecodable as err:
            types, sub, _ = err.args
            undecodable = True
        inner = types if i == 0 else inner
        if keep and sub:
            values.extend(sub)
    if undecodable:
        raise _Undecodable((GGUFValueType.ARRAY, *inner), None, count)
    return (GGUFValueType.ARRAY, *inner), values, count


def _strings(buf: _Bytes, count: int, keep: bool, what: str) -> list[str] | None:
    """``count`` strings: the hot loop of a vocabulary (151,936 of them), so no method calls."""
    data, pos, size, unpack = buf.data, buf.pos, buf.size, _LENGTH.unpack_from
    raw = [] if keep else None
    for _ in range(count):
        if pos + 8 > size:
            raise _truncated(buf.path, what, pos, 8, size)
        (n,) = unpack(data, pos)
        pos += 8
        if pos + n > size:
            raise _truncated(buf.path, what, pos, n, size)
        if keep:
            raw.append(data[pos:pos + n])
        pos += n
    buf.pos = pos
    if raw is None:
        return None
    try:
        return [b.decode("utf-8") for b in raw]
    except UnicodeDecodeError:
        raise _Undecodable((GGUFValueType.ARRAY, GGUFValueType.STRING), None, count) from None


def _tensor_entry(buf: _Bytes, index: int, total: int) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor info: name, dims (innermost first), ggml type, offset in the data section."""
    label = f"tensor info {index + 1} of {total}"
    name = _text(buf.path, buf.string(f"the name of {label}"), label)
    (n_dims,) = buf.unpack(_U32, f"the dimension count of tensor {name!r}")
    start = buf.take(8 * n_dims, f"the {n_dims} dimensions of tensor {name!r}")
    dims = struct.unpack_from(f"<{n_dims}Q", buf.data, start)
    raw_type, offset = buf.unpack(_TYPE_OFFSET, f"the type and offset of tensor {name!r}")
    return name, dims, raw_type, offset


def _tensors(path: Path, entries, data_start: int) -> tuple[TensorInfo, ...]:
    """Entries -> TensorInfo, with GGUFReader's n_bytes (elements * type size // block size)."""
    out, seen = [], set()
    for name, dims, raw_type, offset in entries:
        if name in seen:
            raise _corrupt(path, f"tensor {name!r} appears twice")
        seen.add(name)
        try:
            kind = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise _corrupt(path, f"tensor {name!r} has ggml type {raw_type}, which gguf-py does not know "
                                 "(if ggml added it since: update gguf)") from None
        if dims and dims[0] % block:  # GGUFReader refuses it too (quant_shape_to_byte_shape)
            raise _corrupt(path, f"tensor {name!r} ({kind.name}) has rows of {dims[0]} values, "
                                 f"not a multiple of its block of {block}")
        n_bytes = math.prod(dims) * type_size // block
        out.append(TensorInfo(name, tuple(dims), kind, data_start + offset, n_bytes))
    return tuple(out)


def _alignment(path: Path, field: Field | None) -> int:
    """general.alignment (GGUFReader's checks), or GGUF's default of 32."""
    if field is None:
        return GGUF_DEFAULT_ALIGNMENT
    if field.types != (GGUFValueType.UINT32,):
        raise _corrupt(path, f"general.alignment is of type {'/'.join(t.name for t in field.types)}, not UINT32")
    if field.value == 0 or field.value & (field.value - 1):
        raise _corrupt(path, f"general.alignment is {field.value}, not a power of two")
    return field.value


def _value_type(path: Path, raw: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise _corrupt(path, f"metadata {key!r} has value type {raw}, which GGUF does not define") from None


def _decoded(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _Undecodable((GGUFValueType.STRING,), None, 1) from None


def _text(path: Path, data: bytes, what: str) -> str:
    """A key or tensor name: GGUFReader cannot read a file where one is not UTF-8, nor can we."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _corrupt(path, f"{what} is not UTF-8 text ({data[:40]!r})") from None


def _truncated(path: Path, what: str, start: int, n: int, size: int) -> ValueError:
    return ValueError(f"{path}: truncated or corrupt GGUF header: {what} ({n} bytes at byte {start}) "
                      f"runs past the end of the file ({size} bytes); {_AGAIN}")


def _corrupt(path: Path, what: str) -> ValueError:
    return ValueError(f"{path}: corrupt GGUF header: {what}; the file is damaged or not a GGUF model: {_AGAIN}")


def _read_with_gguf_py(path: Path, skip: Collection[str]) -> GgufFile:
    """A file this reader leaves to gguf-py (big-endian, other versions): its reader, our types."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError) as err:
        raise ValueError(f"{path}: not a readable GGUF file ({err}); it may be truncated or not GGUF "
                         f"at all: {_AGAIN}") from None
    fields = {name: Field(name, tuple(f.types), None if name in skip else _contents(f),
                          len(f.data) if f.types and f.types[0] == GGUFValueType.ARRAY else 1)
              for name, f in reader.fields.items()}
    tensors = tuple(TensorInfo(t.name, tuple(int(d) for d in t.shape), GGMLQuantizationType(t.tensor_type),
                               int(t.data_offset), int(t.n_bytes)) for t in reader.tensors)
    version = int(reader.fields["GGUF.version"].parts[0][0])
    return GgufFile(path, version, fields, tensors, int(reader.alignment), int(reader.data_offset), raw=False)


def _contents(field) -> Any:
    try:
        return field.contents()
    except (AttributeError, ValueError, IndexError):
        return None


_U32 = struct.Struct("<I")
_ARRAY_HEAD = struct.Struct("<IQ")  # element type, element count
_TYPE_OFFSET = struct.Struct("<IQ")  # a tensor's ggml type, its offset in the data section
_STRUCTS = {vtype: struct.Struct(fmt) for vtype, fmt in _SCALAR.items()}
