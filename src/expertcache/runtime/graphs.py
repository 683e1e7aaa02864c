"""Decode replayed from a captured graph: one replay a token, the policy between replays.

With ``planner="device"`` a MoE step reads nothing back to the host, so a whole decode
forward (every layer, attention and the device step inside) can be captured once and
replayed. ``DecodeGraphs`` (``model.expertcache.graphs``) owns, per batch size, a
``_Runner``: a transformers ``StaticCache`` and fixed input buffers (token ids ``[B, 1]``,
``cache_position`` ``[1]``) and an output buffer (float32 logits ``[B, V]``).

One generation::

    prefill (eager: model(...) into the static cache; the host planner's path, hooks as usual)
    per new token:
        host: the lagged policy (DevicePlanner.begin_forward: observe the routing the last
              replay recorded to pinned memory, after its event; apply the slot changes due,
              a few batched copies on the stream, no sync)
        replay: the step traced whole by torch.compile(fullgraph=True); CUDA: its kernels
              captured in a torch.cuda.CUDAGraph and replayed; CPU: the compiled call itself
        host: sample the next token from the logits buffer (greedy, or transformers'
              temperature / top-k / top-p warpers and torch.multinomial: what generate does),
              write it into the ids buffer, read it back (the token's one wait)

Slot changes are applied with ``DeviceStep.apply`` between replays, not with the fixed-shape
``apply_fixed`` inside the graph: a fixed list copies its whole width every token (sized for
the worst forward, 2 x L x B x K rows: gigabytes a token at Qwen3-30B-A3B's size), where
``apply`` copies the rows that changed, from their staging rows on the device (a staging
block per layer: runtime/engine.py).

Where capture does not apply (``graphs="off"``, the host planner, ``auto`` on the CPU, a batch
wider than the staging rows, sampling knobs the loop does not implement) decode runs eagerly
through ``model.generate`` and ``summary()["reason"]`` says why.
"""

from __future__ import annotations

import inspect
import os

import torch

# The CPU's compile backend: 'eager' runs the whole captured FX graph (the proof: one graph, no
# break) and compiles in seconds; 'inductor' generates code (minutes on a small CPU).
CPU_BACKEND = os.environ.get("EXPERTCACHE_GRAPH_BACKEND", "eager")
# generation_config fields whose logits processors the replayed loop does not run
_UNSUPPORTED = ("repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
                "begin_suppress_tokens", "min_new_tokens", "forced_bos_token_id", "forced_eos_token_id",
                "sequence_bias", "encoder_repetition_penalty", "min_p", "typical_p", "epsilon_cutoff",
                "eta_cutoff", "min_length", "exponential_decay_length_penalty", "guidance_scale",
                "watermarking_config")
_NEUTRAL = (None, 0, 1.0, [], ())


class DecodeGraphs:
    """Captured decode steps of one offloaded model, by batch size (see the module doc)."""

    def __init__(self, cache) -> None:
        self.cache, self.mode = cache, cache.config.graphs
        self.runners: dict[int, _Runner] = {}
        self.replays = self.breaks = self.captures = 0
        self.active = False   # whether the latest generation replayed its decode
        self.refused = self._refusal()  # the setting's verdict, fixed for the cache's life
        self.reason = self.refused      # why the latest generation decoded eagerly (None: it replayed)
        self.how = None if self.refused else ("cuda-graph" if cache.device.type == "cuda"
                                              else f"torch.compile(fullgraph=True, backend={CPU_BACKEND!r})")

    def _refusal(self) -> str | None:
        cache = self.cache
        if self.mode == "off":
            return "graphs='off': decode runs eagerly"
        if self.mode == "auto" and cache.device.type != "cuda":
            return "graphs='auto' captures on CUDA only; on the CPU give graphs='on' (the step compiled whole)"
        if cache.planner is None and cache.config.planner == "host":
            return "capture needs planner='device' (the host planner reads each step's routing back)"
        if cache.planner is None:
            return f"capture needs the device planner; {cache.planner_reason}"
        return None

    @property
    def enabled(self) -> bool:
        return self.refused is None

    def refusal(self, model, batch: int, sampling) -> str | None:
        """Why a generation of ``batch`` sequences with ``sampling`` cannot replay (None: it can)."""
        if self.refused is not None:
            return self.refused
        step = self.cache.planner.step
        if not step.fits(batch):
            return (f"a batch of {batch} needs min({batch} x top-k, experts) staging rows per block; the "
                    f"blocks hold {step.width} (give staging={batch * step.top_k})")
        config = model.generation_config
        for name in _UNSUPPORTED:
            if getattr(config, name, None) not in _NEUTRAL:
                return f"generation_config.{name}={getattr(config, name)!r}: the replayed loop does not apply it"
        if not sampling.greedy and sampling.temperature <= 0:
            return "temperature must be above 0 to sample"
        return None

    def runner(self, model, batch: int, length: int) -> _Runner:
        """The runner for ``batch`` sequences of up to ``length`` tokens (built, or rebuilt
        larger, when the one held is too short)."""
        held = self.runners.get(batch)
        if held is None or held.length < length:
            limit = getattr(model.config, "max_position_embeddings", None) or length
            size = min(max(length, 2 * held.length if held else 256), max(limit, length))
            self.runners[batch] = held = _Runner(self, model, batch, size)
        return held

    def generate(self, model, input_ids: torch.Tensor, max_new_tokens: int, sampling,
                 on_tokens=None, stop=lambda: False) -> torch.Tensor:
        """New tokens ``[B, N]`` (N <= max_new_tokens) for prompts ``input_ids`` ``[B, P]`` (no
        padding), decode replayed; ``on_tokens(list of B ids)`` after each; ``stop()`` polled
        after each token ends the run. Sequences that met an end-of-sequence id are padded with
        ``pad_token_id``, as ``model.generate`` pads them."""
        B, P = input_ids.shape
        runner = self.runner(model, B, P + max_new_tokens)
        eos = model.generation_config.eos_token_id
        eos = torch.tensor(sorted(set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])),
                           dtype=torch.long)
        pad = model.generation_config.pad_token_id
        pad = pad if pad is not None else (int(eos[0]) if len(eos) else 0)
        warpers = _warpers(sampling)
        sampling.seed_now()
        self.active = True
        done = torch.zeros(B, dtype=torch.bool)
        new = []
        logits = runner.prefill(input_ids)
        for i in range(max_new_tokens):
            tokens = _pick(logits, warpers)                                  # [B] on the device
            tokens_h = tokens.tolist()                                       # the token's one wait
            tokens_h = [pad if d else t for t, d in zip(tokens_h, done.tolist())]
            new.append(tokens_h)
            done |= torch.isin(torch.tensor(tokens_h), eos)
            if on_tokens is not None:
                on_tokens(tokens_h)
            if i == max_new_tokens - 1 or bool(done.all()) or stop():
                break
            if done.any():  # finished sequences feed pad, as generate does
                tokens = torch.tensor(tokens_h, device=tokens.device)
            logits = runner.decode(tokens)
        return torch.tensor(new, dtype=torch.long).T.reshape(B, -1)

    def summary(self) -> dict:
        return {"mode": self.mode, "how": self.how, "active": self.active,
                "captured": sorted(self.runners), "captures": self.captures, "replays": self.replays,
                "breaks": self.breaks, "reason": self.reason}


class _Runner:
    """One batch size's static cache, buffers and captured step."""

    def __init__(self, graphs: DecodeGraphs, model, batch: int, length: int) -> None:
        from transformers import StaticCache

        self.graphs, self.model, self.cache = graphs, model, graphs.cache
        self.batch, self.length = batch, length
        device = self.cache.device
        self.kv = StaticCache(config=model.config, max_cache_len=length)
        params = inspect.signature(model.forward).parameters
        # transformers 5.2x names the cache argument 'cache' ('past_key_values' deprecated);
        # 5.17 knows only 'past_key_values' (tests/test_graphs.py pins both)
        self.kv_name = "cache" if "cache" in params else "past_key_values"
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=device)      # [B, 1]
        self.position = torch.zeros(1, dtype=torch.long, device=device)          # cache_position [1]
        self.logits = torch.zeros((batch, model.config.get_text_config().vocab_size), dtype=torch.float32,
                                  device=device)                                 # [B, V]
        self.fn = None          # the captured step: a CUDA graph's replay or the compiled function
        self.cuda = device.type == "cuda"

    def _kwargs(self, **extra) -> dict:
        return {self.kv_name: self.kv, "use_cache": True, **self.keep, **extra}

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt's forward, eager (through the model's hooks: phase, clock); logits [B, V]."""
        P = input_ids.shape[1]
        self.kv.reset()  # zeroes in place: the captured step's tensors keep their addresses
        out = self.model(input_ids=input_ids.to(self.cache.device),
                         **self._kwargs(cache_position=torch.arange(P, device=self.cache.device)))
        self.position.fill_(P)
        return out.logits[:, -1].float()

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step for tokens [B]: the policy on the host, then one replay; logits [B, V]."""
        cache, clock = self.cache, getattr(self.model, "_expertcache_clock", None)
        if clock is not None:
            clock._before(self.model, (), {"input_ids": self.ids})
        cache.set_phase(1, self.batch)  # the lagged policy: observe, apply what is due
        if not cache.planner.active:
            raise RuntimeError("a replayed decode step left the device path (the staging rows no longer fit)")
        self.ids.copy_(tokens.view(-1, 1))
        if self.fn is None:
            self.fn = self._capture()
        else:
            self.fn()
        self.graphs.replays += 1
        step = cache.planner.step
        if self.cuda:  # the routing the step recorded to pinned memory: the host waits on this
            step.routed_event = torch.cuda.current_stream(cache.device).record_event()
        self.position.add_(1)
        logits = self.logits.clone()
        if clock is not None:
            clock._after(self.model, (), {}, None)
        return logits

    def _step(self) -> None:
        out = self.model.forward(input_ids=self.ids, **self._kwargs(cache_position=self.position))
        self.logits.copy_(out.logits[:, -1])

    def _counters(self):
        """A function that puts the static cache's own position counters (transformers 5.2x
        keeps one per layer, advanced inside the step) back where they are now: the warm-up
        runs before a capture must not move them."""
        kept = [(t, t.clone()) for t in (getattr(layer, "cumulative_length", None) for layer in self.kv.layers)
                if isinstance(t, torch.Tensor)]

        def rewind():
            for tensor, value in kept:
                tensor.copy_(value)
        return rewind

    def _capture(self):
        """Capture (CUDA) or compile (CPU) the step; it has run once when this returns. Where
        that fails the step runs eagerly from now on and ``summary()['reason']`` says why."""
        graphs = self.graphs
        graphs.captures += 1
        try:
            _room_for_runners()
            # traced whole or raises (fullgraph): no silent break. On CUDA too: the capture then
            # records the traced graph's kernels, so the code that runs is the code the CPU tests
            # trace (transformers' eager-only branches, some with a host read, stay out)
            fn = torch.compile(self._step, fullgraph=True, backend="eager" if self.cuda else CPU_BACKEND)
            if not self.cuda:
                fn()
                return fn
            return _cuda_graph(fn, self.cache.device, self._counters())
        except Exception as err:  # noqa: BLE001  any failure to capture: decode on, eagerly, and say so
            if isinstance(err, torch._dynamo.exc.Unsupported):  # a graph break, refused by fullgraph
                graphs.breaks += 1
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            if os.environ.get("EXPERTCACHE_GRAPH_DEBUG"):
                raise
            if self.cuda:  # the traced step failed to trace or to capture: try the eager step
                return self._capture_eager(f"{type(err).__name__}: {first}")
            return self._eager(f"capture failed, decode eager: {type(err).__name__}: {first}")

    def _capture_eager(self, why: str):
        """CUDA, where the traced step failed (dynamo refused it, or its capture failed): capture
        the eager step itself. The device step
        reads nothing back, so the recording is the same kernels; a host read that the trace
        would have caught fails the capture instead (CUDA refuses a sync while it records),
        and decode then runs eagerly."""
        try:
            replay = _cuda_graph(self._step, self.cache.device, self._counters())
        except Exception as err:  # noqa: BLE001
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            return self._eager(f"capture failed, decode eager: dynamo: {why}; eager capture: "
                               f"{type(err).__name__}: {first}")
        self.graphs.how = f"cuda-graph of the eager step (dynamo refused it: {why})"
        return replay

    def _eager(self, reason: str):
        graphs = self.graphs
        graphs.reason = graphs.refused = reason
        graphs.active = False
        self._step()  # the step's writes are the same whatever ran of it before
        return self._step


def _room_for_runners() -> None:
    """Every runner compiles the same code (``_Runner._step``) for its own ``self``, which
    dynamo counts as recompiles of one frame (8 by default, then fullgraph fails): allow one
    per runner a long-lived process may build (models x batch sizes)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 256))


def _cuda_graph(step, device, rewind=lambda: None):
    """Warm ``step`` up on a side stream (it compiles there), capture it, replay it once;
    returns the replay. ``rewind()`` after each warm-up undoes what a run advances itself."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up: the same inputs, so its writes are the replay's
        for _ in range(2):
            step()
            rewind()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rewind()  # a no-op after a real capture (nothing ran); kept so a fake capture that runs is exact
    graph.replay()
    return graph.replay


def _warpers(sampling) -> list | None:
    """transformers' own warpers, in generate's order (temperature, top-k, top-p); None: greedy."""
    if sampling.greedy:
        return None
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    warpers = [] if sampling.temperature == 1.0 else [TemperatureLogitsWarper(float(sampling.temperature))]
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(int(sampling.top_k)))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(float(sampling.top_p)))
    return warpers


def _pick(logits: torch.Tensor, warpers: list | None) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]: argmax (greedy), or the warpers then one multinomial
    draw from torch's generator, as generate samples."""
    if warpers is None:
        return logits.argmax(-1)
    scores = logits
    for warp in warpers:
        scores = warp(None, scores)
    return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
