"""The routing a benchmark replays and the model shape it runs, from the CLI's choices.

``--trace FILE`` replays a recorded trace (shape from ``--preset``, or from the
trace's model name when it names a preset); ``--preset NAME`` alone generates a
synthetic trace of that preset; neither gives the built-in default trace. Then
``--layers N`` keeps the first N MoE layers and ``--tokens N`` the first N tokens.
Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from ..presets import PRESETS, ModelShape, preset
from ..trace.format import Trace, load_trace


def load_workload(trace: str | Path | None = None, preset_name: str | None = None,
                  tokens: int | None = None, layers: int | None = None,
                  seed: int = 0) -> tuple[Trace, ModelShape]:
    """(trace cut to ``layers`` x ``tokens``, the preset whose expert dims the bench uses)."""
    _check_optional_count("--tokens", tokens)
    _check_optional_count("--layers", layers)
    if trace is not None:
        tr = load_trace(trace)
        shape = preset(preset_name) if preset_name else _preset_of(tr, trace)
        _check_compatible(tr, shape, trace)
    elif preset_name is not None:
        from ..trace.synth import synth_trace
        shape = preset(preset_name)
        tr = synth_trace(shape.name, tokens or 256, seed=seed)
    else:
        from ..trace.synth import default_trace
        tr = default_trace()
        shape = preset(tr.meta["model"])
    return cut(tr, layers, tokens), shape


def cut(trace: Trace, layers: int | None, tokens: int | None) -> Trace:
    """The first ``layers`` MoE layers and first ``tokens`` tokens of ``trace``."""
    if layers is not None and layers > trace.num_layers:
        raise ValueError(f"--layers {layers} exceeds the trace's {trace.num_layers} MoE layers")
    if tokens is not None and tokens > trace.num_tokens:
        raise ValueError(f"--tokens {tokens} exceeds the trace's {trace.num_tokens} tokens; "
                         f"give at most {trace.num_tokens}")
    L = layers or trace.num_layers
    T = tokens or trace.num_tokens
    if (L, T) == (trace.num_layers, trace.num_tokens):
        return trace
    meta = {**trace.meta, "n_moe_layers": L}
    w = None if trace.weights is None else trace.weights[:L, :T].copy()
    ph = None if trace.phase is None else trace.phase[:T].copy()
    return Trace(trace.experts[:L, :T].copy(), meta, w, ph)


def _preset_of(trace: Trace, path) -> ModelShape:
    """The preset a trace's ``meta['model']`` names (e.g. 'Qwen3-30B-A3B-Q4_K_M')."""
    model = str(trace.meta.get("model", "")).lower()
    for name in sorted(PRESETS, key=len, reverse=True):
        if model.startswith(name):
            return PRESETS[name]
    raise ValueError(f"{path}: cannot tell the model shape from meta model={trace.meta.get('model')!r}; "
                     f"give --preset (one of {', '.join(PRESETS)}) for the expert dimensions")


def _check_compatible(trace: Trace, shape: ModelShape, path) -> None:
    if trace.num_experts != shape.experts or trace.top_k != shape.top_k:
        raise ValueError(f"{path} has {trace.num_experts} experts, top-{trace.top_k} but preset "
                         f"{shape.name!r} has {shape.experts}, top-{shape.top_k}; give the matching --preset")


def _check_optional_count(flag: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{flag} must be a whole number >= 1, got {value!r}")
