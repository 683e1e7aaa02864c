"""Which of a GGUF's dense tensors stay as stored bytes (``runtime/cpudense.py``) on the CPU.

A tensor does when the run computes on the CPU with ggml (``cpu_kernel`` 'ggml', or 'auto'
with libggml-python installed), it is 2-D and not F32, it lands in an ``nn.Linear`` or
``nn.Embedding`` of the same shape, transformers' GGUF tensor processor leaves its values
as stored or only reorders its rows, and ggml has a kernel for its type. A reordered
tensor (arch ``llama``'s q and k: llama.cpp's converter permutes their rows for ggml's
interleaved RoPE, transformers' processor undoes it) is kept as a copy of its stored rows
in transformers' order: quantized blocks never cross a row, so the reorder is exact.
Every other tensor is dequantized as before; ``DenseReport`` says which stayed torch and why.
"""

from __future__ import annotations

import numpy as np
import torch

from ..ggufmodel.header import _EXPERT, GgufModel, TensorRef
from ..quant import ggml
from ..runtime.cpudense import DenseReport, GgmlEmbedding, GgmlLinear
from ..runtime.host import file_bytes

_REASON = "ggml's quantized CPU kernels ({}) on the file's bytes: ggml_mul_mat for linears, ggml_get_rows " \
          "for the embedding"


def dense_choice(choice: str, device: torch.device) -> DenseReport:
    """The run's dense kernel before any tensor is placed (``choice``: ``CacheConfig.cpu_kernel``)."""
    if device.type != "cpu":
        return DenseReport("torch", f"dense weights dequantized to float for {device.type}")
    kernel, why = ggml.choose(choice, [])  # 'ggml' without the library raises, naming the extra
    if kernel != "ggml":
        return DenseReport("torch", f"dense weights dequantized to float ({why})")
    return DenseReport("ggml", _REASON.format(ggml.available()[1]))


def place_stored(model: torch.nn.Module, header: GgufModel, names: dict[str, str], processor,
                 dtype: torch.dtype, report: DenseReport) -> set[str]:
    """Swap in ggml modules for the tensors that qualify; returns their GGUF names (the
    caller dequantizes the rest). ``names``: GGUF name -> transformers parameter name."""
    if report.kernel != "ggml":
        return set()
    placed = set()
    for name, ref in header.tensors.items():
        if _EXPERT.match(name) or len(ref.shape) != 2 or names.get(name) is None:
            continue
        module_name, _, param = names[name].rpartition(".")
        module = _module(model, module_name)
        if param != "weight" or not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        why, order = _why_not(ref, module, processor, names)
        if why:
            report.fallback[module_name] = why
            continue
        model.set_submodule(module_name, _stored(ref, module, dtype, order))
        report.ggml.append(module_name)
        placed.add(name)
    return placed


def tie_stored(model: torch.nn.Module, report: DenseReport) -> bool:
    """With tied embeddings and a stored embedding, the lm_head computes on the same bytes."""
    embed = model.get_input_embeddings()
    if not isinstance(embed, GgmlEmbedding):
        return False
    head = GgmlLinear(embed.data, embed.ggml_type, embed.rows, embed.cols, bias=False)
    model.set_output_embeddings(head)
    report.ggml.append("lm_head (tied)")
    return True


def _module(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _why_not(ref: TensorRef, module: torch.nn.Module, processor,
             names: dict[str, str]) -> tuple[str | None, np.ndarray | None]:
    """(why this tensor stays a torch float tensor, or None when ggml computes on its bytes;
    the row order transformers puts its rows in, or None when it keeps the stored one)."""
    if ref.fmt.name == "F32":
        return "F32: float already", None
    if ref.fmt.ggml_type < 0 or not ggml.has_kernel(ref.fmt.ggml_type):
        return f"no ggml CPU kernel for {ref.fmt.name}", None
    shape = (module.out_features, module.in_features) if isinstance(module, torch.nn.Linear) \
        else (module.num_embeddings, module.embedding_dim)
    if tuple(ref.shape) != shape:
        return f"stored shape {tuple(ref.shape)} is not the module's {shape}", None
    order = _row_order(processor, ref, names)
    if order is False:
        return "transformers' GGUF processor rewrites it", None
    return None, order


def _row_order(processor, ref: TensorRef, names: dict[str, str]) -> np.ndarray | None | bool:
    """What transformers' tensor processor does to this tensor, probed with one column of row
    numbers: None (passes it through), the stored row of each row it outputs ([rows] int64: a
    reorder, arch ``llama``'s q and k), or False (anything else: a rename, changed values)."""
    rows = ref.shape[0]
    probe = np.arange(rows, dtype=np.float32).reshape(rows, 1)                     # [rows, 1]
    result = processor.process(weights=probe, name=ref.name, tensor_key_mapping=names,
                               parsed_parameters={"tensors": {}})
    out = np.asarray(result.weights)
    if result.name != ref.name or out.shape != probe.shape:
        return False
    if np.array_equal(out, probe):
        return None
    order = out[:, 0].astype(np.int64)
    return order if np.array_equal(np.sort(order), probe[:, 0]) else False


def _stored(ref: TensorRef, module: torch.nn.Module, dtype: torch.dtype,
            order: np.ndarray | None = None) -> torch.nn.Module:
    """The ggml module over the tensor's bytes: the mapped file, or with ``order`` a copy of its
    rows in that order (each row's blocks whole)."""
    data = file_bytes(ref.file, ref.offset, 1, ref.nbytes, "mmap").view(-1)        # [nbytes] uint8, mapped
    rows, cols = ref.shape
    if order is not None:
        data = data.view(rows, -1)[torch.from_numpy(order)].reshape(-1)           # [nbytes] uint8, a copy
    if isinstance(module, torch.nn.Embedding):
        return GgmlEmbedding(data, ref.fmt.ggml_type, rows, cols, dtype, module.padding_idx)
    return GgmlLinear(data, ref.fmt.ggml_type, rows, cols, bias=module.bias is not None)
