"""Loading a model for the cache: its dense part ready to move to the device, its experts
in the host tier (``runtime/host.py`` builds every host tensor).

Three sources, one result ``(model, [(name, experts module)], [host experts per layer])``:

- ``checkpoint.py``: a transformers checkpoint directory or a model already loaded
  (float experts taken out of the modules);
- ``gguf.py``: a GGUF file (the dense part dequantized, the experts kept in their blocks);
- ``hf_quant.py``: an HF checkpoint with GPT-OSS MXFP4 or block-FP8 experts.

They share ``common.py`` (finding the experts modules, a model built empty), the compute
dtype (``runtime.device.compute_dtype``) and the host-memory mode
(``runtime.host.host_mode``). This module only dispatches; it imports torch lazily.
"""

from __future__ import annotations

from pathlib import Path

from ..ggufmodel.header import is_gguf
from .declared import check_cache_size, model_context

__all__ = ["load", "model_kind", "check_model_path", "load_tokenizer", "check_cache_size", "model_context"]


def load(model_or_path, config, device):
    """``(model, found, hosts)`` for ``offload()``: ``model_or_path`` is a loaded transformers
    model, a checkpoint directory (float, MXFP4 or block FP8) or a GGUF file."""
    from .checkpoint import load_dir, take_experts

    if not isinstance(model_or_path, (str, Path)):
        return take_experts(model_or_path, config, device)
    path = Path(model_or_path)
    kind = model_kind(path)
    if kind != "gguf" and config.host_memory == "tiered":  # experts read by offset from the safetensors
        from .tiered_checkpoint import load_tiered_checkpoint
        return load_tiered_checkpoint(path, config, device)
    if kind == "gguf":
        from .gguf import load_gguf
        return load_gguf(path, config, device)[:3]
    if kind == "hf-quant":
        from .hf_quant import load_hf_quantized
        return load_hf_quantized(path, config, device)
    return load_dir(path, config, device)


def model_kind(path: Path) -> str:
    """How ``offload`` loads ``path``: 'gguf' (a GGUF file), 'hf-quant' (a checkpoint with MXFP4
    or block-FP8 experts, kept quantized) or 'checkpoint' (a plain save_pretrained directory)."""
    from .hf_quant import QUANT_METHODS, quant_method

    if is_gguf(path):
        return "gguf"
    return "hf-quant" if quant_method(path) in QUANT_METHODS else "checkpoint"


def check_model_path(path: Path) -> None:
    """Refuse a missing or unusable model early: a GGUF file (header read) or a checkpoint directory."""
    from ..ggufmodel.header import read_header
    from .checkpoint import check_checkpoint_dir

    if is_gguf(Path(path)):
        read_header(path)
    else:
        check_checkpoint_dir(Path(path))


def load_tokenizer(path: str | Path):
    """The tokenizer saved next to a local checkpoint, or in a GGUF file (nothing is downloaded)."""
    if is_gguf(Path(path)):
        from .gguf import load_gguf_tokenizer
        return load_gguf_tokenizer(Path(path))
    from .checkpoint import load_dir_tokenizer
    return load_dir_tokenizer(Path(path))
