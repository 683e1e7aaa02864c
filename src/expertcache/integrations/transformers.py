"""``offload()``: run a Hugging Face transformers MoE model with the two-tier expert cache.

Attaches through transformers' official experts hook (``ExpertsInterface`` +
``set_experts_implementation``): no model class is patched. Expert weights leave the
experts modules for host memory before the rest of the model moves to the device, so
the device never holds all experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import DTYPES, CacheConfig
from ..runtime.clock import ForwardClock
from ..runtime.engine import ExpertCache
from ..runtime.experts import IMPLEMENTATION, expertcache_experts_forward
from ..runtime.host import HostExperts, check_layout

_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # config.DTYPES names torch dtypes
# quantized experts the codec cannot read (block FP8 and MXFP4 load: integrations/hf_quant.py)
_UNSUPPORTED_QUANT = {"fbgemm_fp8": "per-channel FP8 (fbgemm_fp8)"}


def offload(model_or_path, *, config: CacheConfig | None = None, **settings):
    """Keep ``model_or_path``'s experts in host memory behind a device slot pool; returns the model.

    ``model_or_path``: a loaded transformers MoE model (changed in place), a local
    checkpoint directory, or a GGUF file (``model.gguf`` or the first part of a split
    one; its experts stay quantized: docs/quantized.md).
    ``settings`` are ``CacheConfig``'s fields, checked before anything loads (or pass
    ``config``): ``slots`` or ``gpu_memory``, ``eviction`` / ``admission`` (names, specs such
    as ``'slru:protected=0.5'``, or ``PolicySpec``s; ``eviction_params`` / ``admission_params``
    by name), ``partition``, ``miss``, ``baseline``, ``device``, ``dtype``, ``staging``,
    ``imatrix`` (path to an imatrix .gguf, trace or counts file whose hot experts are placed
    before the first forward; ``imatrix_mode`` 'pin' keeps them, 'seed' lets them be evicted),
    ``slot_format`` ('auto', 'quantized', 'dequantized') and ``host_memory`` ('auto', 'copy',
    'mmap') for quantized experts, ``hardware`` (a preset or probe profile) for the cost
    model of ``miss='auto'``.
    ``model.expertcache`` then exposes ``stats()``, ``reset_stats()``, ``slot_bytes``, ``config``.
    """
    if config is not None and settings:
        raise TypeError(f"offload() takes either config or settings, not both (got {', '.join(settings)})")
    if config is None:
        config = CacheConfig(**settings)
    kind = model_kind(Path(model_or_path)) if isinstance(model_or_path, (str, Path)) else None
    if kind == "gguf":
        return _offload_gguf(Path(model_or_path), config)
    if kind == "hf-quant":
        return _offload_hf_quant(Path(model_or_path), config)
    model = load_checkpoint(model_or_path, config.dtype) if isinstance(model_or_path, (str, Path)) \
        else model_or_path
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"offload() takes a transformers model or a checkpoint directory, "
                        f"got {type(model_or_path).__name__}")
    placed = set(map(str, (getattr(model, "hf_device_map", None) or {}).values()))
    if len(placed) > 1 or placed & {"disk", "meta"}:
        raise ValueError(f"this model is dispatched over {sorted(placed)} by a device_map; accelerate "
                         "would copy modules on every forward. Load it with device_map='cpu' (or pass "
                         "the checkpoint directory) and let offload() place it")
    if getattr(model, "expertcache", None) is not None:
        raise ValueError("this model is already offloaded (model.expertcache exists); load a fresh copy")
    found = find_experts(model)
    counts = _imatrix_counts(config, found)  # a bad file fails before the experts leave the model
    if config.dtype is not None:
        model.to(_DTYPES[config.dtype])
    for name, module in found:
        check_layout(module, name)
    hosts = [HostExperts.take(module, pin=torch.cuda.is_available()) for _, module in found]
    return attach(model, found, hosts, config, counts)


def _offload_gguf(path: Path, config: CacheConfig) -> torch.nn.Module:
    """A GGUF file: the dense part loaded, the experts kept quantized in the host tier."""
    from ..ggufmodel.load import load_gguf

    model, found, hosts, _ = load_gguf(path, config, _device(config.device))
    return attach(model, found, hosts, config, _imatrix_counts(config, found))


def _offload_hf_quant(path: Path, config: CacheConfig) -> torch.nn.Module:
    """An HF checkpoint with MXFP4 or block-FP8 experts: they stay quantized in the host tier."""
    from .hf_quant import load_hf_quantized

    check_checkpoint_dir(path)
    model, found, hosts = load_hf_quantized(path, config, _device(config.device))
    return attach(model, found, hosts, config, _imatrix_counts(config, found))


def attach(model: torch.nn.Module, found, hosts, config: CacheConfig, counts=None) -> torch.nn.Module:
    """Build the cache over ``hosts`` (one per experts module in ``found``) and hook it in.

    Shared by checkpoints (experts taken from the modules) and GGUF files (experts read
    from the file): on any refusal the experts go back and the model is as it was.
    """
    miss = config.effective().miss
    try:
        for name, module in found:
            if miss != "fetch" and getattr(module, "has_post_expert_norm", False):
                raise ValueError(f"{name}: experts with a post-expert norm support only miss='fetch'")
        _check_uniform(hosts, found)
        cache = ExpertCache(config, hosts, _top_k(model, found), _device(config.device),
                            _hardware(config), counts)
    except Exception:  # sizing refused: hand the experts back so the model is as it was
        for host, (_, module) in zip(hosts, found):
            host.restore(module)
        raise
    model.to(cache.device)  # the dense part; the experts modules no longer hold their weights
    for layer, (_, module) in enumerate(found):
        module._expertcache = (cache, layer)
    _attach(model, cache)
    return model


def _imatrix_counts(config: CacheConfig, found):
    """The imatrix counts, read and checked once (None without --imatrix)."""
    if config.imatrix is None:
        return None
    from ..imatrix.apply import check_source
    return check_source(config.imatrix, len(found), found[0][1].num_experts)


def _hardware(config: CacheConfig):
    """The cost model's rates for the 'auto' miss path (a preset or a probe profile)."""
    from ..sim.hardware import DEFAULT, load_hardware
    return load_hardware(config.hardware or DEFAULT)


def _device(name: str | None) -> torch.device:
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cuda, cuda:N or cpu") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but torch sees no CUDA device "
                         f"(torch {torch.__version__}); use device='cpu' or a CUDA build of torch")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {name!r} is not supported yet; use cuda or cpu")
    return device


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def find_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The experts modules in forward order (MoE-layer index = position in this list)."""
    found = [(name, m) for name, m in model.named_modules()
             if hasattr(m, "num_experts") and (hasattr(m, "_expertcache") or any(
                 hasattr(m, kind) or hasattr(m, kind + "_blocks")
                 for kind in ("gate_up_proj", "up_proj", "down_proj")))]
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE layers (no experts module holding fused "
                         "gate_up_proj/down_proj); expertcache needs a Mixture-of-Experts model such as "
                         "Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, DeepSeek-V3 or Granite-MoE")
    return found


def _check_uniform(hosts: list[HostExperts], found) -> None:
    def layout(host):  # quantized layers may store types that differ, but compute the same weights
        return host.layout() if host.codec is None else host.codec.compute_layout()
    first = layout(hosts[0])
    for host, (name, _) in zip(hosts, found):
        if layout(host) != first:
            raise ValueError(f"{name}: expert shapes or types differ between MoE layers ({layout(host)} vs "
                             f"{first}); one slot pool needs identical experts in every layer")


def _top_k(model: torch.nn.Module, found) -> int:
    k = getattr(model.config, "num_experts_per_tok", None)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"cannot read top-k from {type(model.config).__name__} (num_experts_per_tok)")
    return k


def _attach(model: torch.nn.Module, cache: ExpertCache) -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, expertcache_experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)
    model.expertcache = cache
    model.register_forward_pre_hook(_phase_hook(cache), with_kwargs=True)
    cache.model = model
    ForwardClock.of(model)  # times every forward from now on: model.expertcache.report()


def _phase_hook(cache: ExpertCache):
    """Tell the cache whether this forward is prefill (several new tokens) or decode (one)."""
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        cache.set_phase(ids.shape[1] if isinstance(ids, torch.Tensor) and ids.ndim >= 2 else None)
    return hook


def load_checkpoint(path: str | Path, dtype: str | None):
    """Load a local checkpoint on the host, refusing missing files and unsupported layouts first."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    check_checkpoint_dir(path)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=_DTYPES[dtype] if dtype else "auto", device_map="cpu", local_files_only=True)


def model_kind(path: Path) -> str:
    """How ``offload`` loads ``path``: 'gguf' (a GGUF file), 'hf-quant' (a checkpoint with MXFP4
    or block-FP8 experts, kept quantized) or 'checkpoint' (a plain save_pretrained directory)."""
    from ..ggufmodel.load import is_gguf
    from .hf_quant import QUANT_METHODS, quant_method

    if is_gguf(path):
        return "gguf"
    return "hf-quant" if quant_method(path) in QUANT_METHODS else "checkpoint"


def check_model_path(path: Path) -> None:
    """Refuse a missing or unusable model early: a GGUF file (header read) or a checkpoint directory."""
    from ..ggufmodel.header import read_header
    from ..ggufmodel.load import is_gguf

    if is_gguf(path):
        read_header(path)
    else:
        check_checkpoint_dir(path)


def model_context(path: Path) -> int | None:
    """The context in tokens a model file declares, read without loading it (the GGUF header's
    ``<arch>.context_length`` or config.json's ``max_position_embeddings``); None if it says none."""
    return _declared(path, "context_length", ("max_position_embeddings",))


def check_cache_size(path: Path, config: CacheConfig) -> None:
    """Refuse ``slots`` below the model's top-k before loading it (read from the GGUF header or
    config.json): the same check and message the table makes once the model is loaded."""
    from ..cache import partition_shares

    top_k = _declared(path, "expert_used_count", ("num_experts_per_tok",))
    experts = _declared(path, "expert_count", ("num_experts", "num_local_experts", "n_routed_experts"))
    if config.slots is None or not config.needs_size or top_k is None or experts is None:
        return
    if config.partition == "global":  # per-layer needs the MoE layer count: the table checks it
        partition_shares(1, experts, config.slots, "global", min(top_k, experts))


def _declared(path: Path, gguf_key: str, hf_keys: tuple[str, ...]) -> int | None:
    """A positive whole number the model declares: ``<arch>.gguf_key`` in a GGUF header, the
    first of ``hf_keys`` in config.json (or its text_config); None when absent or unreadable."""
    from ..ggufmodel.load import is_gguf

    if is_gguf(path):
        from ..ggufmodel.header import read_header
        header = read_header(path)
        value = header.metadata.get(f"{header.arch}.{gguf_key}")
    else:
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        scopes = (cfg, cfg.get("text_config") or {})
        value = next((s[k] for k in hf_keys for s in scopes if s.get(k) is not None), None)
    try:
        value = int(value)
    except (TypeError, ValueError):
        return None
    return value if value > 0 else None


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
    _check_weight_files(path)


def _check_weight_files(path: Path) -> None:
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


def load_tokenizer(path: str | Path):
    """The tokenizer saved next to a local checkpoint, or in a GGUF file (nothing is downloaded)."""
    from transformers import AutoTokenizer

    from ..ggufmodel.load import is_gguf, load_gguf_tokenizer
    if is_gguf(Path(path)):
        return load_gguf_tokenizer(Path(path))
    # Without tokenizer files transformers still builds a tokenizer from config.json's model
    # type, with an empty vocabulary: every prompt then encodes to no tokens and the failure
    # shows up far away ("cannot reshape tensor of 0 elements"). Say what is missing instead.
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
             "spiece.model")
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in files):
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
