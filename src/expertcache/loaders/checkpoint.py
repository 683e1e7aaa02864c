"""Float checkpoints: a local transformers checkpoint directory, or a model already loaded.

The model is loaded on the host as transformers writes it, then each experts module's
weights are taken out into ``HostExperts`` (deleted from the module, so moving the
model to the device leaves them behind).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import CacheConfig
from ..runtime.device import DTYPES
from ..runtime.host import HostExperts, check_layout, host_mode
from .common import find_experts

# quantized experts the codec cannot read (block FP8 and MXFP4 load: hf_quant.py)
_UNSUPPORTED_QUANT = {"fbgemm_fp8": "per-channel FP8 (fbgemm_fp8)"}


def load_checkpoint(path: str | Path, dtype: str | None):
    """Load a local checkpoint on the host, refusing missing files and unsupported layouts first.

    ``dtype`` None keeps the checkpoint's own float dtype."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    check_checkpoint_dir(path)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype] if dtype else "auto", device_map="cpu", local_files_only=True)


def load_dir(path: Path, config: CacheConfig, device: torch.device):
    """(model, found, hosts) of a float checkpoint directory (bad settings refused before loading)."""
    host = _host_mode(config, device)
    return take_experts(load_checkpoint(path, config.dtype), config, device, host)


def _host_mode(config: CacheConfig, device: torch.device) -> tuple[str, str]:
    return host_mode(config.host_memory, device, "float expert weights taken from the model")


def take_experts(model, config: CacheConfig, device: torch.device, host: tuple[str, str] | None = None):
    """(model, [(name, experts module)], [HostExperts per layer]): ``model``'s experts moved to host memory."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload() takes a transformers model or a checkpoint directory (or a GGUF file), "
                        f"got {type(model).__name__}")
    placed = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
    if len(placed) > 1 or placed & {"disk", "meta"}:
        raise ValueError(f"this model is dispatched over {sorted(placed)} by a device_map; accelerate "
                         "would copy modules on every forward. Load it with device_map='cpu' (or pass "
                         "the checkpoint directory) and let offload() place it")
    if getattr(model, "expertcache", None) is not None:
        raise ValueError("this model is already offloaded (model.expertcache exists); load a fresh copy")
    found = find_experts(model)
    mode, reason = host or _host_mode(config, device)
    if config.dtype is not None:
        model.to(DTYPES[config.dtype])
    for name, module in found:
        check_layout(module, name)
    return model, found, [HostExperts.take(module, mode, reason) for _, module in found]


def check_checkpoint_dir(path: Path) -> None:
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path} (give a local directory "
                                "written by save_pretrained; nothing is downloaded)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"incomplete checkpoint {path}: no config.json")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"incomplete checkpoint {path}: config.json is not valid JSON ({err})") from None
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant in _UNSUPPORTED_QUANT:
        raise ValueError(f"{path}: {_UNSUPPORTED_QUANT[quant]} experts (quantization_config "
                         f"quant_method={quant!r}) are not supported; use a bf16/fp16/fp32, block-FP8 "
                         "(quant_method 'fp8') or GPT-OSS MXFP4 checkpoint, or a GGUF file")
    check_weight_files(path)


def check_weight_files(path: Path) -> None:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                raise ValueError(f"incomplete checkpoint {path}: {index_name} lists shard(s) that are "
                                 f"missing: {', '.join(missing)}")
            return
    if not any((path / n).is_file() for n in ("model.safetensors", "pytorch_model.bin")):
        raise ValueError(f"incomplete checkpoint {path}: no weights (model.safetensors, "
                         "model.safetensors.index.json or pytorch_model.bin)")


def load_dir_tokenizer(path: Path):
    """The tokenizer saved next to a local checkpoint (nothing is downloaded)."""
    from transformers import AutoTokenizer

    # Without tokenizer files transformers still builds a tokenizer from config.json's model
    # type, with an empty vocabulary: every prompt then encodes to no tokens and the failure
    # shows up far away ("cannot reshape tensor of 0 elements"). Say what is missing instead.
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
             "spiece.model")
    if path.is_dir() and not any((path / name).is_file() for name in files):
        raise ValueError(f"{path}: no tokenizer in the checkpoint directory (none of "
                         f"{', '.join(files)}); save one next to the weights (tokenizer.save_pretrained)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: no usable tokenizer in the checkpoint directory ({err}); "
                         "save one next to the weights (tokenizer.save_pretrained)") from None
    if len(tokenizer) < 2:  # tokenizer files that hold no vocabulary
        raise ValueError(f"{path}: the checkpoint's tokenizer has an empty vocabulary; save the "
                         "model's tokenizer next to the weights (tokenizer.save_pretrained)")
    return tokenizer
