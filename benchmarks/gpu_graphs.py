"""Decode with graphs on and off, side by side (issue 30): tok/s against its bound, one table.

Each setting builds the step of ``gpu_check.py``'s real rows (Qwen3-30B-A3B's expert shape:
hidden 2048, 128 experts, top-8, expert FF 768, bf16; ``--layers`` MoE layers, 12 by default)
on the device, routed by the real code trace when one is here (else synthetic), offloads it
with ``planner="device"`` and decodes greedily twice per batch size on the same cache: graphs
off (``model.generate``, eager) then on (``model.expertcache.graphs``: one replay a token).
Rows: resident, copy-every-pass, 25 / 50 / 100 % slots; 1 and 16 sequences.

Each row: steady tok/s (all sequences), decode hit rate, H2D MB a token, the bound (weights
read on the device plus H2D bytes, over the bandwidths measured at the start with plain torch
copies) and the fraction of it reached, and ``exact``: greedy tokens equal to plain
transformers (the model before offload, same routing).

    python benchmarks/gpu_graphs.py [--layers 12] [--tokens 32] [--batches 1,16]
        [--rows resident,copy-every-pass,25,50,100] [--json OUT]
    python benchmarks/gpu_graphs.py --rehearse      # the CPU, toy sizes, under a minute

On an H200 (the lead's lease): ``run(command="python benchmarks/gpu_graphs.py --json
$OUT/gpu_graphs.json", carry=[".gpu-trace"], timeout_s=400)``; estimated 150-250 s (ten
builds of 15 GB on the device, each pinning its experts; per build an eager and a replayed
decode, the latter traced by dynamo first, 5-10 s for 12 layers). A quick set, about 60 s:
``--rows resident,25 --batches 1``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import REAL, TOY, measure_bandwidth  # noqa: E402
from gpu_decode import build, routing  # noqa: E402

from expertcache import offload  # noqa: E402
from expertcache.runtime.clock import ForwardClock  # noqa: E402
from expertcache.runtime.sampling import Sampling  # noqa: E402

ROWS = {"resident": dict(baseline="resident"), "copy-every-pass": dict(baseline="copy-every-pass"),
        "25": dict(fraction=0.25), "50": dict(fraction=0.5), "100": dict(fraction=1.0)}


def say(*parts) -> None:
    print(*parts, flush=True)


class PositionRouting:
    """Routers forced to the trace's experts at each token's position: the position comes from
    the decoder's ``position_ids`` (a pre-hook on the first layer), so a captured step replays
    the right row every token. Sequence b reads trace row ``position + b * stride``."""

    def __init__(self, ids, device) -> None:
        self.ids = torch.as_tensor(ids, device=device)               # [L, T, K]
        self.positions = None

    def attach(self, model) -> None:
        from expertcache.integrations.record import _router_of
        from expertcache.loaders.common import find_experts

        model.model.layers[0].register_forward_pre_hook(self._positions, with_kwargs=True)
        for layer, (name, _) in enumerate(find_experts(model)):
            _router_of(model, name).register_forward_hook(self._hook(layer))

    def _positions(self, module, args, kwargs) -> None:
        self.positions = kwargs["position_ids"]                      # [1 or B, T]

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, scores, _ = output                               # [B*T, E], [B*T, K], [B*T, K]
            total = self.ids.shape[1]
            pos = self.positions[:1]                                 # [1, T]: no padding, rows alike
            B = logits.shape[0] // pos.shape[1]
            rows = (pos + 97 * torch.arange(B, device=pos.device).unsqueeze(1)) % total  # [B, T]
            ids = self.ids[layer].index_select(0, rows.reshape(-1))  # [B*T, K]
            weights = torch.softmax(logits.float().gather(1, ids), dim=-1).to(scores.dtype)
            return logits, weights, ids
        return hook


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(model, ids, tokens: int, warm: int, graphs: bool) -> tuple[list, float]:
    """Greedy decode of warm + tokens; (tokens [B, N], steady seconds of the last ``tokens``)."""
    clock = ForwardClock.of(model)
    clock.start()
    n = warm + tokens
    with torch.no_grad():
        if graphs:
            out = model.expertcache.graphs.generate(model, ids, n, Sampling())
        else:
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)[:, ids.shape[1]:]
    steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]  # decode forwards
    return out.tolist(), sum(steps[-tokens:])


def row_settings(name: str, size: dict, batch: int) -> dict:
    s = dict(ROWS[name])
    fraction = s.pop("fraction", None)
    if fraction is not None:
        s["slots"] = round(fraction * size["layers"] * 128)
    if name != "resident":
        s["staging"] = min(batch * 8, 128)  # a block of B x top-k rows per layer (one in all:
        #                                     copy-every-pass admits nothing)
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rehearse", action="store_true", help="the CPU, toy sizes (graphs via torch.compile)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=32, help="timed decode tokens")
    ap.add_argument("--warm", type=int, default=8, help="decode tokens before the timed ones")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rows", default="resident,copy-every-pass,25,50,100")
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--bandwidth", metavar="JSON", help="bandwidths measured by gpu_check.py bandwidth "
                    "(the same bound as the check's other rows), else measured here")
    args = ap.parse_args(argv)
    size = dict(TOY if args.rehearse else REAL)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.rehearse else "cpu")
    size.update(device=str(device), layers=2 if args.rehearse else args.layers)
    if args.rehearse:
        args.tokens, args.warm, args.prompt = min(args.tokens, 6), min(args.warm, 2), min(args.prompt, 8)
    batches = [int(b) for b in args.batches.split(",")]
    if args.rehearse:  # each batch size of each row compiles once: keep the CPU's share small
        batches = [1] if args.batches == "1,16" else [min(b, 4) for b in batches]
    known = args.bandwidth and Path(args.bandwidth).exists()
    measured = json.loads(Path(args.bandwidth).read_text()) if known else measure_bandwidth(device)
    bw = {"device_read": measured["device_gbs"] * 1e9, "h2d": measured["h2d_gbs"] * 1e9}
    say(f"gpu_graphs on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: "
        f"{size['layers']} layers, device read {bw['device_read'] / 1e9:.0f} GB/s, H2D {bw['h2d'] / 1e9:.1f} GB/s")
    trace, source = routing(size["layers"], 4096)
    say(f"routing: {source}")
    force = PositionRouting(trace, device)
    results, refs = [], {}
    plain = build(size)
    force.attach(plain)
    for B in batches:
        ids = torch.randint(1, size["vocab"], (B, args.prompt), generator=torch.Generator().manual_seed(B)).to(device)
        out, _ = run(plain, ids, args.tokens, args.warm, graphs=False)
        refs[B] = (ids, out)
    dense = sum(p.numel() * p.element_size() for n, p in plain.named_parameters() if ".experts." not in n)
    del plain
    release(device)  # the plain model's cycles hold its 15-60 GB until collected (48 layers: 27 GiB
    #                  were left for a 30 GiB pool on the H200, 2026-12-04)
    say(f"{'row':<16}{'B':>4}{'graphs':>8}{'tok/s':>10}{'hit':>7}{'H2D MB/tok':>12}{'bound':>10}{'frac':>7}"
        f"{'exact':>7}  note")
    for name in args.rows.split(","):
        for B in batches:  # a cache per batch size: its staging rows are B x top-k a layer
            ids, ref = refs[B]
            try:
                model = build(size)
                force.attach(model)
                model = offload(model, planner="device", graphs="on", device=str(device),
                                **row_settings(name, size, B))
                cache = model.expertcache
            except Exception as err:  # noqa: BLE001  a row that fails is printed; the rest still run
                say(f"{name:<16}{B:>4}  failed to build: {type(err).__name__}: {err}")
                continue
            for graphs in (False, True):
                try:
                    cache.reset_stats()
                    out, seconds = run(model, ids, args.tokens, args.warm, graphs)
                    results.append(report(name, B, graphs, out, ref, seconds, args.tokens, cache, dense, bw))
                except Exception as err:  # noqa: BLE001
                    traceback.print_exc(limit=3)
                    say(f"{name:<16}{B:>4}{'on' if graphs else 'off':>8}  failed: {type(err).__name__}: {err}")
            del model, cache
            release(device)
    if args.json:
        Path(args.json).write_text(json.dumps({"size": size, "bandwidth": bw, "rows": results}, indent=2))
    return 0


def report(name, B, graphs, out, ref, seconds, tokens, cache, dense, bw) -> dict:
    stats = cache.stats()
    decode = stats.total("decode")
    steps = len(out[0]) - 1  # decode forwards since reset_stats (the first token is prefill's)
    h2d = stats.h2d_bytes("decode") / steps                          # a decode step
    read = dense + decode.accesses / steps * cache.expert_bytes      # device bytes a step
    bound = B / (read / bw["device_read"] + h2d / bw["h2d"])
    tok_s = B * tokens / seconds
    g = cache.graphs.summary()
    note = (f"{g['replays']} replays, {g['breaks']} breaks" if graphs and g["active"]
            else (g["reason"] or "") if graphs else "eager")
    r = {"row": name, "batch": B, "graphs": graphs, "tok_s": tok_s, "hit_rate": decode.hit_rate,
         "h2d_mb_per_token": h2d / 1e6, "bound_tok_s": bound, "fraction": tok_s / bound,
         "exact": out == ref, "graphs_summary": g}
    say(f"{name:<16}{B:>4}{'on' if graphs else 'off':>8}{tok_s:>10.1f}{decode.hit_rate or 0:>7.3f}"
        f"{h2d / 1e6:>12.1f}{bound:>10.0f}{tok_s / bound:>7.3f}{str(r['exact']):>7}  {note}")
    return r


if __name__ == "__main__":
    sys.exit(main())
