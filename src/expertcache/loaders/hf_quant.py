"""HF-native quantized MoE checkpoints for the cache: the experts stay in their stored bytes.

Two layouts (``quantization_config.quant_method`` in config.json):

- ``mxfp4`` (GPT-OSS): ``experts.gate_up_proj_blocks [E, 2I, H/32, 16]`` + ``_scales
  [E, 2I, H/32]``, the same for ``down_proj``, float biases. An HF MXFP4 block is a ggml
  MXFP4 block with its nibbles in another order, so each layer is repacked once at load
  (``quant.hf.mxfp4_hf_to_ggml``: no dequantization) and the GGUF code path runs it. Rows are
  output features, gate and up interleaved as GPT-OSS's ``_apply_gate`` reads them.
- ``fp8`` (DeepSeek-V3, Qwen3-FP8): ``float8_e4m3fn`` weights with a float32
  ``weight_scale_inv`` per ``weight_block_size`` tile, per expert
  (``experts.N.{gate,up,down}_proj.weight``, as the released checkpoints) or fused
  (``experts.gate_up_proj`` + ``gate_up_proj_scale_inv``). Experts keep the raw float8 bytes
  and their scales; the non-expert FP8 linears are dequantized into the model, as
  transformers does on a machine without FP8 kernels.

transformers cannot keep either format quantized on a CPU (it dequantizes the whole model
without triton/kernels or a CUDA FP8 GPU), and would hold every expert in bf16. Here the
model is built empty (``common.empty_model``), the dense tensors are read with
``safetensors.safe_open`` and assigned, and the experts go into a ``QuantExperts`` per layer
(in RAM, pinned with CUDA: ``runtime.host``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..config import CacheConfig
from ..quant.formats import quant_format
from ..quant.hf import FP8_E4M3, fp8_block, mxfp4_hf_to_ggml
from ..runtime.device import compute_dtype
from ..runtime.host import expert_kinds, host_mode, resident
from ..runtime.quantized import Codec, Kind, Part, QuantExperts
from .checkpoint import check_checkpoint_dir, check_weight_files
from .common import drop_expert_params, empty_model, find_experts

QUANT_METHODS = {"mxfp4": "GPT-OSS MXFP4", "fp8": "block FP8"}
_FLOAT_FORMATS = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_CHUNK = 8  # experts repacked at once (MXFP4)
_SKIPPED = ("activation_scale", "input_scale")  # static-activation extras: refused below, never loaded


def quant_method(path: Path) -> str | None:
    """``quantization_config.quant_method`` of a checkpoint directory (None when unquantized)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return (cfg.get("quantization_config") or {}).get("quant_method")


def load_hf_quantized(path: str | Path, config: CacheConfig, device: torch.device):
    """(model with empty experts modules, [(name, experts module)], [QuantExperts per layer])."""
    from transformers import AutoConfig

    path = Path(path)
    check_checkpoint_dir(path)
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    qcfg = _quant_settings(path, getattr(hf_config, "quantization_config", None) or {})
    del hf_config.quantization_config  # build plain experts modules: the cache serves them
    # repacked at load, so they live in RAM: refuses host_memory='mmap' before any work
    mode, reason = host_mode(config.host_memory, device, f"{QUANT_METHODS[qcfg['quant_method']]} experts, read "
                             "from the safetensors once and kept quantized")
    dtype = compute_dtype(config.dtype, device)
    model = empty_model(hf_config, dtype)
    found = find_experts(model)
    with _Checkpoint(path) as ckpt:
        prefixes = tuple(name + "." for name, _ in found)
        _load_dense(model, ckpt, prefixes, qcfg, path)
        build = _mxfp4_layer if qcfg["quant_method"] == "mxfp4" else _fp8_layer
        layers = [build(ckpt, name, module, qcfg, dtype) for name, module in found]
    hosts = []
    for (name, module), (tensors, codec) in zip(found, layers):
        _check_shapes(name, module, codec)
        hosts.append(QuantExperts({k: resident(t, mode) for k, t in tensors.items()}, codec, mode, reason))
    drop_expert_params(found)
    return model.eval(), found, hosts


def _quant_settings(path: Path, qcfg) -> dict:
    """The quantization_config as a dict, refusing settings the codec cannot reproduce."""
    qcfg = qcfg if isinstance(qcfg, dict) else qcfg.to_dict()
    method = qcfg.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(f"{path}: quant_method {method!r} is not an HF-native layout expertcache reads "
                         f"({', '.join(QUANT_METHODS)})")
    if method == "fp8":
        if qcfg.get("scale_fmt", "float") not in ("float", None) or qcfg.get("expert_dtype", "fp8") != "fp8":
            raise ValueError(f"{path}: FP8 with scale_fmt={qcfg.get('scale_fmt')!r} / expert_dtype="
                             f"{qcfg.get('expert_dtype')!r} is not supported; expertcache reads float32 "
                             "block scales over float8_e4m3fn experts (DeepSeek-V3, Qwen3-FP8)")
        if qcfg.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"{path}: FP8 activation_scheme={qcfg.get('activation_scheme')!r} is not supported "
                             "(only 'dynamic': expertcache dequantizes the weights and computes in float)")
        block = qcfg.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ValueError(f"{path}: FP8 quantization_config needs weight_block_size [rows, cols] (block FP8); "
                             f"got {block!r} (per-tensor or per-channel FP8 is not supported)")
        qcfg["weight_block_size"] = (int(block[0]), int(block[1]))
    return qcfg


class _Checkpoint:
    """Every tensor name of a safetensors checkpoint and a reader for one tensor."""

    def __init__(self, path: Path) -> None:
        check_weight_files(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        elif (path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise ValueError(f"{path}: quantized checkpoints are read from safetensors; found only "
                             "pytorch_model.bin")
        self.path, self.files, self.where = path, files, {}

    def __enter__(self) -> _Checkpoint:
        from safetensors import safe_open

        self.handles = [safe_open(str(self.path / f), framework="pt") for f in self.files]
        for handle in self.handles:
            self.where.update({k: handle for k in handle.keys()})
        self.keys = sorted(self.where)
        return self

    def __exit__(self, *exc) -> None:
        self.handles = []

    def get(self, key: str) -> torch.Tensor | None:
        handle = self.where.get(key)
        return None if handle is None else handle.get_tensor(key)

    def shape(self, key: str) -> tuple[int, ...] | None:
        handle = self.where.get(key)
        return None if handle is None else tuple(handle.get_slice(key).get_shape())

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """``tensor[start:stop]`` read from the file without reading the rest."""
        return self.where[key].get_slice(key)[start:stop]

    def need(self, key: str) -> torch.Tensor:
        tensor = self.get(key)
        if tensor is None:
            raise ValueError(f"{self.path}: tensor {key} is missing from the checkpoint")
        return tensor


def _load_dense(model, ckpt: _Checkpoint, experts: tuple[str, ...], qcfg: dict, path: Path, rename=None) -> None:
    """Assign every tensor outside the ``experts`` modules (FP8 linears dequantized into the model's
    dtype); ``rename``: checkpoint name -> the model's (transformers' renamings), or None."""
    targets = model.state_dict()  # meta tensors: names and dtypes
    state = {}
    for stored in ckpt.keys:
        key = rename(stored) if rename else stored
        if key.startswith(experts) or key.endswith(("weight_scale_inv",) + _SKIPPED) or key not in targets:
            continue
        tensor = ckpt.need(stored)
        scale = ckpt.get(stored + "_scale_inv") if key.endswith(".weight") else None
        if scale is not None:
            _check_scale(key, tensor, scale, qcfg["weight_block_size"])
            tensor = fp8_block(tensor, scale, qcfg["weight_block_size"], torch.float32)
        elif "float8" in str(tensor.dtype):
            raise ValueError(f"{path}: {key} is {tensor.dtype} without a weight_scale_inv next to it")
        state[key] = tensor.to(targets[key].dtype)
    missing = {k for k in model.load_state_dict(state, strict=False, assign=True).missing_keys
               if not k.startswith(experts)}
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"{path}: tensors missing for {len(missing)} model weights "
                         f"({', '.join(sorted(missing)[:4])}{', ...' if len(missing) > 4 else ''}); "
                         "the checkpoint does not match transformers' layout for this architecture")


def _float_part(name: str, tensor: torch.Tensor, key: str) -> tuple[Part, torch.Tensor]:
    """A float tensor [E, ...] as a part of its own dtype and its bytes [E, nbytes]."""
    if tensor.dtype not in _FLOAT_FORMATS:
        raise ValueError(f"{key} is {tensor.dtype}; expected a float32, float16 or bfloat16 tensor")
    part = Part(name, quant_format(_FLOAT_FORMATS[tensor.dtype]), tuple(tensor.shape[1:]))
    return part, tensor.contiguous().view(torch.uint8).reshape(tensor.shape[0], -1)


def _mxfp4_layer(ckpt: _Checkpoint, prefix: str, module, qcfg: dict, dtype: torch.dtype):
    """GPT-OSS MXFP4 experts of one layer, repacked into ggml MXFP4 parts (+ bias parts)."""
    tensors, parts, kinds = {}, [], []
    for proj, short in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        key = f"{prefix}.{proj}"
        if ckpt.shape(key + "_blocks") is None or ckpt.shape(key + "_scales") is None:
            raise ValueError(f"{ckpt.path}: {key}_blocks / _scales missing; an MXFP4 checkpoint "
                             f"stores every experts projection as *_blocks + *_scales (GPT-OSS layout)")
        shape = ckpt.shape(key + "_scales")
        if len(shape) != 3 or ckpt.shape(key + "_blocks") != (*shape, 16):
            raise ValueError(f"{key}: MXFP4 experts need _blocks [E, R, C/32, 16] and _scales [E, R, C/32], got "
                             f"{ckpt.shape(key + '_blocks')} and {shape}")
        experts, rows, groups = shape
        packed = torch.empty(experts, rows * groups * 17, dtype=torch.uint8)  # E experts, ggml bytes
        for start in range(0, experts, _CHUNK):  # a few experts at a time: repacking needs 2-3x their bytes
            stop = min(start + _CHUNK, experts)
            ggml = mxfp4_hf_to_ggml(ckpt.rows(key + "_blocks", start, stop), ckpt.rows(key + "_scales", start, stop))
            packed[start:stop] = ggml.reshape(stop - start, -1)
        parts.append(Part(f"{short}.weight", quant_format("MXFP4"), (rows, groups * 32)))
        tensors[f"{short}.weight"] = packed
        kinds.append(Kind(proj, "one", (f"{short}.weight",)))
        bias = ckpt.get(f"{prefix}.{proj}_bias")
        if bias is not None:
            part, tensors[f"{short}.bias"] = _float_part(f"{short}.bias", bias, f"{prefix}.{proj}_bias")
            parts.append(part)
            kinds.append(Kind(f"{proj}_bias", "one", (f"{short}.bias",)))
    return tensors, Codec(tuple(parts), tuple(kinds), dtype)


def _fp8_layer(ckpt: _Checkpoint, prefix: str, module, qcfg: dict, dtype: torch.dtype):
    """Block-FP8 experts of one layer: raw float8 parts and their scale parts."""
    block = qcfg["weight_block_size"]
    first = expert_kinds(module)[0]  # gate_up_proj, or up_proj for ungated experts
    if ckpt.get(f"{prefix}.{first}") is not None:  # fused [E, rows, cols], as FP8Experts holds them
        sources = {first: ((first.removesuffix("_proj"), f"{prefix}.{first}"),),
                   "down_proj": (("down", f"{prefix}.down_proj"),)}
        stored = {s: (ckpt.need(key), ckpt.need(key + "_scale_inv"), key) for kind in sources.values()
                  for s, key in kind}
    else:  # one tensor per expert, as the released checkpoints store them
        gated = first == "gate_up_proj"
        sources = {first: (("gate", None), ("up", None)) if gated else (("up", None),),
                   "down_proj": (("down", None),)}
        stored = {s: _stack_experts(ckpt, prefix, s, module.num_experts, block) for kind in sources.values()
                  for s, _ in kind}
    tensors, parts, kinds = {}, [], []
    for kind, names in sources.items():
        pair_names = []
        for short, _ in names:
            weight, scale, key = stored[short]
            _check_scale(key, weight, scale, block)
            parts.append(Part(f"{short}.weight", FP8_E4M3, tuple(weight.shape[1:])))
            tensors[f"{short}.weight"] = weight.contiguous().view(torch.uint8).reshape(weight.shape[0], -1)
            scale_part, tensors[f"{short}.scale"] = _float_part(f"{short}.scale", scale, key + "_scale_inv")
            parts.append(scale_part)
            pair_names += [f"{short}.weight", f"{short}.scale"]
        kinds.append(Kind(kind, "fp8", tuple(pair_names), block))
    return tensors, Codec(tuple(parts), tuple(kinds), dtype)


def _stack_experts(ckpt: _Checkpoint, prefix: str, short: str, experts: int, block: tuple[int, int]):
    """``{prefix}.N.{short}_proj.weight`` (+ scale) for every expert N, stacked: ([E, R, C], [E, nR, nC], key)."""
    weights, scales = [], []
    for e in range(experts):
        key = f"{prefix}.{e}.{short}_proj.weight"
        weight = ckpt.get(key)
        if weight is None:
            raise ValueError(f"{ckpt.path}: expert tensor {key} is missing; an FP8 checkpoint stores each "
                             "expert as experts.N.{gate,up,down}_proj.weight + weight_scale_inv")
        if ckpt.get(f"{prefix}.{e}.{short}_proj.bias") is not None:
            raise ValueError(f"{ckpt.path}: {prefix}.{e}.{short}_proj.bias: FP8 experts with biases are not supported")
        scale = ckpt.get(key + "_scale_inv")
        _check_scale(key, weight, scale, block)
        weights.append(weight)
        scales.append(scale)
    shapes = sorted({tuple(w.shape) for w in weights})
    if len(shapes) > 1:
        raise ValueError(f"{ckpt.path}: {prefix}.N.{short}_proj.weight shapes differ between experts ({shapes})")
    key = f"{prefix}.N.{short}_proj.weight"
    return torch.stack(weights), torch.stack(scales), key


def _check_scale(key: str, weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int]) -> None:
    """One line on an FP8 weight whose dtype or scale grid is not block FP8's."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{key} is {weight.dtype}; block FP8 weights are float8_e4m3fn")
    if scale is None:
        raise ValueError(f"{key} has no weight_scale_inv next to it; block FP8 needs one scale per tile")
    rows, cols = weight.shape[-2:]
    grid = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale.shape) != grid:
        raise ValueError(f"{key}: FP8 weight {tuple(weight.shape)} with {block[0]}x{block[1]} blocks needs "
                         f"weight_scale_inv {grid}, got {tuple(scale.shape)}")


def _check_shapes(name: str, module, codec: Codec) -> None:
    """The decoded experts must have the shapes the model config gives its experts module."""
    transposed = getattr(module, "is_transposed", False)
    for kind, (shape, _) in codec.compute_layout().items():
        param = getattr(module, kind, None)
        if param is None:
            raise ValueError(f"{name}: the checkpoint has {kind} but {type(module).__name__} has no such weight")
        want = tuple(param.shape[1:])
        if transposed and len(want) == 2:
            want = want[::-1]
        if tuple(shape) != want:
            raise ValueError(f"{name}: checkpoint experts give {kind} {tuple(shape)} per expert, the model config "
                             f"expects {want} ([out, in]); config.json and the weights disagree")
