"""Greedy decode of a Qwen3-30B-A3B-shaped model, measured row by row (the GPU check's core).

``benchmarks/gpu_check.py`` drives it: ``build`` makes the model on the device, ``ForcedRouting``
makes every router follow a real routing trace (so plain transformers and each expertcache
configuration route identically and their tokens can be compared), ``decode`` runs B sequences
in a plain loop (no ``generate()``: its own syncs would blur the count), and ``measure`` turns
one configuration into a row: tok/s, exactness against plain transformers, hit rate, H2D bytes,
syncs, host time per MoE step, and the row's **bound**: the tok/s the measured bandwidths allow
for the bytes the row must move a token (weights read on the device plus H2D bytes).

Every row is guarded: an exception becomes a row with ``error`` and the next row runs.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
TRACE_NAME = "qwen3-30b-a3b-code.npz"
EXPERTS, TOP_K = 128, 8
# transformers 5.2x renames past_key_values; the loop below uses the name every 5.x takes
warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)


def say(*parts) -> None:
    print(*parts, flush=True)


# -- routing ---------------------------------------------------------------------------------
def routing(layers: int, tokens: int) -> tuple[np.ndarray, str]:
    """Expert ids [layers, tokens, K] from the real trace when one is here, else synthetic."""
    for path in (ROOT / ".gpu-trace" / TRACE_NAME, ROOT.parent / "shared" / "traces" / TRACE_NAME):
        if path.exists():
            ids = np.load(path)["experts"]
            if ids.shape[0] >= layers and ids.shape[1] >= tokens and ids.shape[2] >= TOP_K:
                return ids[:layers, :tokens, :TOP_K].astype(np.int64), f"real trace {path.name}"
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)] for _ in range(layers)])
    return ids, "synthetic (no trace carried: make gpu-trace)"


class ForcedRouting:
    """Forward hooks that make each router pick the trace's experts: sequence b of a batch of B
    follows the trace from token ``b * stride`` on, so the B sequences route differently."""

    def __init__(self, ids: np.ndarray, device, stride: int) -> None:
        self.ids = torch.as_tensor(ids, device=device)      # [L, N, K]
        self.stride, self.batch = stride, 1
        self.pos = [0] * ids.shape[0]

    def reset(self, batch: int) -> None:
        self.batch, self.pos = batch, [0] * len(self.pos)

    def attach(self, model) -> list:
        from expertcache.integrations.record import _router_of
        from expertcache.loaders.common import find_experts

        routers = [_router_of(model, name) for name, _ in find_experts(model)]
        return [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, scores, _ = output                      # [T, E], [T, K], [T, K]; T = B * n
            B, p = self.batch, self.pos[layer]
            n = logits.shape[0] // B
            self.pos[layer] += n
            rows = (torch.arange(B, device=logits.device)[:, None] * self.stride
                    + torch.arange(p, p + n, device=logits.device)[None, :]).reshape(-1)  # [B*n]
            ids = self.ids[layer].index_select(0, rows)     # [T, K]
            weights = torch.softmax(logits.float().gather(1, ids), dim=-1).to(scores.dtype)
            return logits, weights, ids
        return hook

    def distinct_per_step(self, batch: int, first: int, steps: int) -> float:
        """Mean distinct experts a decode step of ``batch`` sequences reads, summed over layers
        (positions ``first`` .. ``first + steps - 1`` of each sequence)."""
        ids = self.ids.cpu().numpy()
        total = 0
        for s in range(first, first + steps):
            rows = [b * self.stride + s for b in range(batch)]
            total += sum(len(np.unique(ids[layer, rows])) for layer in range(ids.shape[0]))
        return total / steps


# -- the model ---------------------------------------------------------------------------------
def build(size: dict):
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                            num_attention_heads=size["heads"], num_key_value_heads=size["kv"],
                            head_dim=size["head_dim"], num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            moe_intermediate_size=size["ff"], intermediate_size=3 * size["hidden"],
                            decoder_sparse_step=1, vocab_size=size["vocab"], max_position_embeddings=4096,
                            eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(size["device"]):  # built on the device: no pass of the experts through host RAM
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, size["dtype"]))
    return model.eval()


def dense_bytes(model) -> int:
    """Bytes of the weights a decode step reads besides the experts: every parameter but the
    embedding table (a step reads B rows of it) and the experts (counted per use)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


# -- one decode run ---------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    logits: torch.Tensor       # [steps, B, V] float32 on the host: the prompt's last, then each decode step
    tokens: list               # [steps][B] greedy tokens
    tok_s: float               # tokens a second over all B sequences
    syncs_all: float | None    # every sync per decode step (CUDA sync debug mode), None where not counted


def decode(model, force: ForcedRouting, prompt: torch.Tensor, size: dict, clock=None, feed=None) -> Run:
    """Greedy decode of the B sequences of ``prompt`` [B, P]; ``clock`` (a StepClock) counts only
    the timed tokens. ``size``: warm, timed, counted (decode steps of each part; counted may be 0).
    ``feed`` ([steps][B] tokens, the reference's): teacher forcing. Each step's input is the
    reference's token, so every step compares the two models on the same inputs, and a near-tie
    argmax that bf16 rounding flips (the bf16 rows differ from plain by ~3e-2 in the logits) stays
    one disagreement instead of a diverged continuation; ``tokens`` are still this model's argmaxes."""
    cuda = prompt.device.type == "cuda"
    B = prompt.shape[0]
    force.reset(B)
    logits, tokens = [], []
    given = None if feed is None else torch.tensor(feed, device=prompt.device).T   # [B, steps]
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        past, last = out.past_key_values, out.logits[:, -1]     # [B, V]
        logits.append(last)

        def step():
            nonlocal past, last
            tok = last.argmax(-1, keepdim=True)               # [B, 1], stays on the device
            tokens.append(tok)
            if given is not None:
                i = len(tokens) - 1
                tok = given[:, i:i + 1]
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, last = out.past_key_values, out.logits[:, -1]
            logits.append(last)

        for _ in range(size["warm"]):
            step()
        sync(cuda)
        t = time.perf_counter()
        if clock is not None:
            clock.active = True
        for _ in range(size["timed"]):
            step()
        sync(cuda)
        tok_s = B * size["timed"] / (time.perf_counter() - t)
        if clock is not None:
            clock.active = False
        syncs_all = count_syncs(step, size["counted"]) if cuda else None
        if not cuda:
            for _ in range(size["counted"]):
                step()
    return Run(torch.stack(logits).float().cpu(), torch.cat(tokens, dim=1).T.tolist(), tok_s, syncs_all)


def count_syncs(step, steps: int) -> float | None:
    """Every sync per step over ``steps`` more steps (torch's sync debug mode); None for 0 steps."""
    if steps <= 0:
        return None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in seen) / steps


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class StepClock:
    """Host time inside the runtime's MoE step, the waits of its deliberate syncs apart, and
    the count of those syncs, while ``active`` (the timed tokens)."""

    def __init__(self) -> None:
        from expertcache.runtime import experts as mod

        self.mod, self.real = mod, (mod.run_step, mod._ids_to_host, mod._acts_to_host)
        self.steps = self.syncs = 0
        self.step_s = self.sync_s = 0.0
        self.active = False

    def __enter__(self):
        run_step, ids_to_host, acts_to_host = self.real

        def timed_step(*args):
            t = time.perf_counter()
            try:
                return run_step(*args)
            finally:
                if self.active:
                    self.steps += 1
                    self.step_s += time.perf_counter() - t

        def timed_sync(real):
            def call(*args):
                t = time.perf_counter()
                try:
                    return real(*args)
                finally:
                    if self.active:
                        self.syncs += 1
                        self.sync_s += time.perf_counter() - t
            return call

        self.mod.run_step = timed_step
        self.mod._ids_to_host, self.mod._acts_to_host = timed_sync(ids_to_host), timed_sync(acts_to_host)
        return self

    def __exit__(self, *exc) -> None:
        self.mod.run_step, self.mod._ids_to_host, self.mod._acts_to_host = self.real


# -- rows ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Bench:
    """What every row of one model size shares."""
    base: torch.nn.Module      # the model without its experts (they sit in ``hosts``)
    hosts: list                # HostExperts per MoE layer (pinned on CUDA)
    names: list                # the experts modules' names
    force: ForcedRouting
    size: dict
    bandwidth: dict            # {"device_gbs", "h2d_gbs"} measured at the start of the check
    expert_bytes: int          # one expert's bytes (all kinds)
    dense: int                 # dense_bytes(base)
    refs: dict = dataclasses.field(default_factory=dict)   # batch -> plain transformers' Run

    def prompt(self, batch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        return torch.randint(1, self.size["vocab"], (batch, self.size["prompt"]), generator=g).to(self.size["device"])

    def model_with_experts(self):
        """A copy of the model with its experts restored over the same host tensors (no copy)."""
        model = copy.deepcopy(self.base)
        for host, name in zip(self.hosts, self.names):
            host.restore(model.get_submodule(name))
        return model


def row_settings(settings: dict, total: int) -> dict:
    settings = dict(settings)
    settings.pop("batch", None)
    settings.setdefault("planner", "host")  # a row without one is the host planner's (not 'auto')
    if "fraction" in settings:
        settings["slots"] = int(settings.pop("fraction") * total)
    return settings


def measure(bench: Bench, label: str, settings: dict, rows: list) -> dict:
    """One expertcache configuration as a row (appended to ``rows``); any exception becomes a row
    with ``error`` so the next configuration still runs."""
    from expertcache import offload

    batch = settings.get("batch", 1)
    out = {"name": label, "settings": settings, "batch": batch}
    model = handles = None
    try:
        ref = bench.refs[batch]
        model = offload(bench.model_with_experts(), device=bench.size["device"],
                        **row_settings(settings, bench.size["layers"] * EXPERTS))
        handles = bench.force.attach(model)
        with StepClock() as clock:
            run = decode(model, bench.force, bench.prompt(batch), bench.size, clock, feed=ref.tokens)
        out.update(compare(run, ref), **cache_figures(model.expertcache, clock, bench, batch))
        out.update(bound(bench, batch, out.get("h2d_mb_per_token", 0.0), label))
        out["fraction_of_bound"] = out["tok_s"] / out["bound_tok_s"] if out.get("bound_tok_s") else None
    except ValueError as e:          # a configuration the runtime refuses: said, not a crash
        out["refused"] = str(e)
    except Exception as e:  # noqa: BLE001  one row's failure must not end the step
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        for h in handles or []:
            h.remove()
        del model
        release(bench.size["device"])
    rows.append(out)
    say(format_row(out))
    return out


def compare(run: Run, ref: Run) -> dict:
    """Exactness of a teacher-forced run against plain transformers: every greedy token equal,
    the largest logit difference, and at steps whose argmax differs, the reference's own margin
    between its best two tokens there (a flip within the logit difference is a near tie)."""
    steps = len(run.tokens[0])
    diff = (run.logits[:steps + 1] - ref.logits[:steps + 1]).abs()             # [steps+1, B, V]
    agree = [a == b for r, q in zip(run.tokens, ref.tokens) for a, b in zip(r, q[:steps])]
    flips = [(i, b) for b, (r, q) in enumerate(zip(run.tokens, ref.tokens))
             for i, (a, c) in enumerate(zip(r, q[:steps])) if a != c]
    margins = [float(ref.logits[i, b].topk(2).values.diff().abs()) for i, b in flips]
    return {"tok_s": run.tok_s, "tokens_equal": all(agree), "top1_agreement": sum(agree) / len(agree),
            "max_logit_diff": diff.max().item(), "flip_margins": margins[:8],
            "flips_within_diff": all(m <= 2 * diff[i, b].max().item() for m, (i, b) in zip(margins, flips)),
            "syncs_all_per_step": run.syncs_all}


def cache_figures(cache, clock: StepClock, bench: Bench, batch: int) -> dict:
    size = bench.size
    tokens = batch * (size["warm"] + size["timed"] + size["counted"])
    stats = cache.stats()
    summary = cache.summary() if hasattr(cache, "summary") else {}
    figures = {"hit_rate": stats.total("decode").hit_rate,
               "h2d_mb_per_token": stats.h2d_bytes("decode") / tokens / 1e6,
               "pool_mb": cache.slot_bytes / 1e6, "slots": cache.pool.slots, "staging": cache.pool.staging,
               "runtime_syncs_per_step": clock.syncs / size["timed"],
               "host_us_per_moe_step": 1e6 * (clock.step_s - clock.sync_s) / clock.steps if clock.steps else None,
               "planner": summary.get("planner"), "graphs": summary.get("graphs")}
    return figures


def bound(bench: Bench, batch: int, h2d_mb_per_token: float, label: str) -> dict:
    """The tok/s the measured bandwidths allow for this row's bytes: a decode step reads the
    dense weights once and each distinct expert it routes to once (on the device), plus the
    row's H2D bytes over the pinned H2D bandwidth. None for rows that compute experts on the
    host (their bound is the host's memory, not measured here)."""
    bw = bench.bandwidth
    if not bw or "cpu" in label:
        return {"bound_tok_s": None}
    s = bench.size
    experts = bench.force.distinct_per_step(batch, s["prompt"] + s["warm"], s["timed"])
    device_bytes = bench.dense + experts * bench.expert_bytes                    # per decode step
    seconds = device_bytes / (bw["device_gbs"] * 1e9) + batch * h2d_mb_per_token * 1e6 / (bw["h2d_gbs"] * 1e9)
    return {"bound_tok_s": batch / seconds, "device_mb_per_token": device_bytes / batch / 1e6}


def reference(bench: Bench, batch: int, rows: list) -> None:
    """Plain transformers with every expert on the device: the reference tokens and logits."""
    model = bench.model_with_experts().to(bench.size["device"])
    handles = bench.force.attach(model)
    try:
        decode(model, bench.force, bench.prompt(batch)[:, :4], dict(bench.size, warm=1, timed=1, counted=0))
        run = decode(model, bench.force, bench.prompt(batch), bench.size)
    finally:
        for h in handles:
            h.remove()
        del model
        release(bench.size["device"])
    bench.refs[batch] = run
    out = {"name": f"plain transformers, all on the device, B={batch}", "batch": batch, "tok_s": run.tok_s,
           "tokens_equal": True, "max_logit_diff": 0.0, "syncs_all_per_step": run.syncs_all}
    out.update(bound(bench, batch, 0.0, out["name"]))
    out["fraction_of_bound"] = out["tok_s"] / out["bound_tok_s"] if out.get("bound_tok_s") else None
    rows.append(out)
    say(format_row(out))


def peer(bench: Bench, budget_bytes: int, rows: list) -> None:
    """What a Hugging Face user does when the experts do not fit: accelerate's big-model
    dispatch (``device_map="auto"`` with ``max_memory``) at the GPU memory of a cache row.
    Decoder layers past the budget stay in (pageable) host memory and are copied to the GPU on
    every forward by accelerate's hooks. Guarded like every row."""
    label = f"peer: accelerate offload at {budget_bytes / 2**30:.1f} GiB"
    out = {"name": label, "batch": 1, "settings": {"max_memory_gib": budget_bytes / 2**30}}
    model = None
    try:
        from accelerate import dispatch_model, infer_auto_device_map

        model = bench.model_with_experts()
        dev = bench.size["device"]
        if dev == "cuda":
            device_map = infer_auto_device_map(model, max_memory={0: budget_bytes, "cpu": 10**15},
                                               no_split_module_classes=model._no_split_modules)
            for name, where in device_map.items():
                module = model.get_submodule(name) if name else model
                module.to("cpu" if where == "cpu" else "cuda:0")
                for p in module.parameters() if where == "cpu" else ():
                    if p.is_pinned():   # the experts' pinned store: a user's weights are pageable
                        p.data = p.data.clone()
            model = dispatch_model(model, device_map=device_map, main_device="cuda:0")
            out["layers_offloaded"] = sum(1 for v in device_map.values() if v == "cpu")
        handles = bench.force.attach(model)
        try:
            ref = bench.refs[1]
            run = decode(model, bench.force, bench.prompt(1), dict(bench.size, warm=1, timed=min(4, bench.size["timed"]),
                                                                   counted=0), feed=ref.tokens)
        finally:
            for h in handles:
                h.remove()
        out.update(compare(run, ref))
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    finally:
        del model
        release(bench.size["device"])
    rows.append(out)
    say(format_row(out))


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def format_row(r: dict) -> str:
    def f(key, fmt, width):
        v = r.get(key)
        return f"{'-':>{width}}" if v is None else f"{v:{width}{fmt}}"
    if "error" in r or "refused" in r:
        return f"  {r['name'][:46]:46} {'ERROR' if 'error' in r else 'refused'}: {r.get('error') or r.get('refused')}"
    return (f"  {r['name'][:46]:46} {r['tok_s']:8.1f} tok/s  bound {f('bound_tok_s', '.0f', 6)} "
            f"({f('fraction_of_bound', '.3f', 5)})  equal {equal(r):11} diff {r['max_logit_diff']:.1e}"
            f"  hit {f('hit_rate', '.3f', 5)}  H2D {f('h2d_mb_per_token', '.1f', 7)} MB/tok"
            f"  syncs {f('runtime_syncs_per_step', '.0f', 3)}/{f('syncs_all_per_step', '.0f', 3)}"
            f"  host {f('host_us_per_moe_step', '.0f', 5)} us/step")


def equal(r: dict) -> str:
    """'True', or the share of equal greedy tokens and whether every flip was a near tie."""
    if r["tokens_equal"]:
        return "True"
    return f"{r.get('top1_agreement', 0):.3f}{' ties' if r.get('flips_within_diff') else ' !!'}"


def compile_policies() -> None:
    """Numba compiles the built-in policies on first use: once here, not inside a measured row."""
    from expertcache.cache import SlotTable

    t = time.perf_counter()
    table = SlotTable(1, 16, 8)
    for e in range(16):
        table.step(0, [e])
    say(f"policy kernels ready in {time.perf_counter() - t:.1f} s (NUMBA_CACHE_DIR: {os.environ.get('NUMBA_CACHE_DIR')})")
