"""A model larger than its memory limit: the RAM tier against mmap + the page cache (issue 33).

One GGUF several times the RAM budget (random Qwen3-MoE weights, experts in Q4_0, built here
and kept), decoded on the CPU engine (``baseline='resident'``: every expert computed from host
bytes by ggml; 32 sampled tokens, seeded) in a memory cgroup (v1, ``memory.limit_in_bytes``).
Each tier budget (``--shares``, default 25 and 50% of the experts) is run against mmap in one
limit, the same for both:

- ``mmap``: ``host_memory='mmap'``, the file's pages cached by the OS inside the limit (experts
  read in place: ``cpu_repack='off'``);
- ``tiered N%``: ``host_memory='tiered'``, a RAM tier of that share of the experts, the rest
  read with O_DIRECT, decoded as one ggml graph a token (runtime/ggmltier.py);
- ``tiered N% rows plain`` (``--rows-plain``): the same, its rows the file's bytes
  (``cpu_repack='off'``) instead of ggml's repacked layout;
- ``tiered N% per-layer`` (``--per-layer``): the same tier on the per-layer path
  (``cpu_graph='off'``), what tiered decode was before the graph read the tier.

The limit of a pair is the peak RSS of a calibration run of its tier (no limit) plus
``--slack`` (128 MiB: at 64 MiB the dense weights' page cache thrashed in the 50% limit),
after a warm-up run that compiles what a fresh checkout's first process would.
Each run is its own process, placed in the cgroup before it imports anything, after the page
cache was dropped; configurations are interleaved over ``--repeats`` rounds, each round between
two all-in-RAM reference runs (``host_memory='copy'``, no limit; the round's all-in-RAM speed is
their mean, since the machine's speed drifts) whose tokens every run must produce (the runs on
ggml's plain kernels, ``cpu_repack='off'``, those of one all-in-RAM run on the same kernels:
the repacked ones sum in another order, and a sampled token can differ). Bytes from
disk: the process's ``/proc/self/io`` ``read_bytes`` over the decode forwards, per decode token
(with the prompt's reads too: ``all_disk_bytes_per_token``). The disk bound: the O_DIRECT read
bandwidth measured on the file (4 reader threads, 512 KiB blocks) over a run's disk bytes per
decode token (measured before and after each round; their mean scores the round); the bound:
the lower of it and the all-in-RAM speed; the serial bound: the
all-in-RAM time plus the disk time, what a decode reaches whose reads start at their layer's
routing. Without a cgroup (not root, no v1 memory controller) the runs go unlimited and the
script says so. ``--layer-update F`` builds a model whose layers add F x as much to the residual
stream: below 1 its routing moves less with the context and the tier reads more (docs/tiers.md,
"Where 0.7 of the bound holds").

    flock /tmp/bench.lock python benchmarks/bench_tiers.py --dir /tmp/tiers-bench --tokens 32 \
        --repeats 3 --json benchmarks/results/bench_tiers.json --png benchmarks/results/bench_tiers.png

On a GPU (`--device cuda --slots 12`): device slots for 12% of the experts sit in front of every
configuration (reference, mmap, tiered), so a slot miss is served from the RAM tier, else from
the file: the tier feeding the slots (`gpu_check.sh --steps tiers`). `--device cpu --slots N`
runs the same path on the CPU engine's slots.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # gguf_models: the tokenizer lists and metadata writer

SHAPE = dict(hidden=1024, expert_ff=768, experts=64, top_k=8, layers=8)
ROUTER_STD, EMBED_STD = 0.08, 0.1
CGROUP = Path("/sys/fs/cgroup/memory")
PROMPT = [5, 9, 77, 120, 3, 44, 200, 17]  # token ids of the byte-level vocabulary


# -- the model ----------------------------------------------------------------------------
def model_path(folder: Path, update: float = 1.0, shared: float = 0.0) -> Path:
    """The bench model's file for these knobs (the default model's name unchanged)."""
    tail = ("" if update == 1 else f"-update{update:g}") + (f"-shared{shared:g}" if shared else "")
    return folder / f"qwen3moe-q4_0-tiers{tail}.gguf"


def build_model(path: Path, seed: int = 0, update: float = 1.0, shared: float = 0.0) -> Path:
    """A Qwen3-MoE GGUF: dense part from a random transformers model (tiny expert FF, so it
    builds in seconds), experts as random Q4_0 blocks of the real FF size. ``update`` scales
    what each layer adds to the residual stream (attention's output projection, the experts'
    down projection): below 1 the context moves the routing less, token to token, and layer
    l's MoE input guesses layer l+1's routing better. ``shared`` adds one direction to every
    token's embedding, ``shared`` times a token's own norm: the tokens route more alike."""
    import gguf
    import numpy as np
    import torch
    import transformers as tf

    from gguf_models import _metadata, tokenizer_lists

    s = SHAPE
    tokens, _, _ = tokenizer_lists()
    torch.manual_seed(seed)
    cfg = tf.Qwen3MoeConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=8,
                            num_key_value_heads=4, head_dim=128, vocab_size=len(tokens), intermediate_size=3072,
                            moe_intermediate_size=8, num_experts=s["experts"], num_experts_per_tok=s["top_k"],
                            decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=4096,
                            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            bos_token_id=len(tokens) - 2, eos_token_id=len(tokens) - 2)
    model = tf.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # routing that varies from token to token, as a trained model's (init's: 0.02)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, ROUTER_STD)
        model.model.embed_tokens.weight.normal_(0, EMBED_STD)  # each token's own direction counts
        if shared:  # drawn after every default draw: shared=0 leaves the file byte for byte as it was
            model.model.embed_tokens.weight.add_(torch.randn(s["hidden"]) * EMBED_STD * shared)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(update)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    cfg.moe_intermediate_size = s["expert_ff"]  # what the metadata says; the tensors agree
    _metadata(writer, cfg, "qwen3moe", True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, s["layers"])
    for hf_name, tensor in model.state_dict().items():
        if ".experts." in hf_name:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    rng = np.random.default_rng(seed)
    E, H, I = s["experts"], s["hidden"], s["expert_ff"]
    for layer in range(s["layers"]):
        for kind, (rows, cols) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            blocks = rng.integers(0, 256, (E, rows, cols // 32, 18), dtype=np.uint8)  # Q4_0: fp16 d + 16 B
            d = rng.uniform(0.002, 0.006, (E, rows, cols // 32)) / np.sqrt(cols / 256)
            d = (d * (update if kind == "down" else 1.0)).astype(np.float16)
            blocks[..., :2] = d.view(np.uint8).reshape(E, rows, cols // 32, 2)
            writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", blocks.reshape(E, rows, -1),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- one run (a child process) --------------------------------------------------------------
def child(spec: dict) -> None:
    if spec.get("cgroup"):
        (Path(spec["cgroup"]) / "cgroup.procs").write_text(str(os.getpid()))
    import torch

    import expertcache
    from expertcache.decode_phases import bounds
    from expertcache.runtime.generate import report
    from expertcache.runtime.threads import ggml_threads

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    # the CPU engine computes every expert from the host (resident); on a GPU, device slots sit in
    # front of the host tier (a slot miss served from RAM, else from the file)
    front = {"slots": spec["slots"]} if spec.get("slots") else {"baseline": "resident"}
    settings = dict(spec["settings"])
    read_ahead = settings.pop("read_ahead", True)  # the bench's switch, not an offload setting
    model = expertcache.offload(spec["model"], device=spec.get("device", "cpu"), **front, **settings)
    load_s = time.perf_counter() - t0
    if not read_ahead and getattr(model.expertcache.tier, "ahead", None) is not None:
        model.expertcache.tier.ahead.min_precision = 2.0  # never reads ahead (still scores its guesses)
    ids = torch.tensor([PROMPT])
    cache = model.expertcache
    cache.reset_stats()
    # /proc/self/io as the first decode forward starts (the prompt's reads end there) and as the
    # steady part of the decode starts (decode_phases.py; the first new token comes from the
    # prompt's forward, so max_new_tokens - 1 decode forwards)
    decoding, forwards = {}, [0]
    steady_from = bounds(spec["tokens"] - 1)["steady"].start
    forward = model.forward

    def first_decode(*a, **kw):
        x = kw.get("input_ids", a[0] if a else None)
        if x is not None and x.shape[1] == 1:
            if "io" not in decoding:
                decoding["io"] = _io()
            if forwards[0] == steady_from:
                decoding["steady"] = _io()
            forwards[0] += 1
        return forward(*a, **kw)
    model.forward = first_decode
    before = _io()
    t0 = time.perf_counter()
    torch.manual_seed(0)  # sampled (seeded): greedy decoding of random weights repeats one token
    out = model.generate(ids, max_new_tokens=spec["tokens"], do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    wall = time.perf_counter() - t0
    after = _io()
    rep = report(model)
    decode = [rep[f"decode_{p}"] for p in ("cold", "warm", "steady")]
    dec_tokens, dec_s = sum(p["tokens"] for p in decode), sum(p["seconds"] for p in decode)
    steady = rep["decode_steady"]  # past the first quarter of the decode: the tier has filled
    tier = cache.stats().pool.get("tier")
    result = {"label": spec["label"], "load_s": load_s, "wall_s": wall, "prefill_s": rep["prefill"]["seconds"],
              "decode_tokens": dec_tokens, "decode_s": dec_s, "tok_s": dec_tokens / dec_s,
              "steady_tok_s": steady["tokens"] / steady["seconds"] if steady["tokens"] else None,
              "disk_read_bytes": after["read_bytes"] - before["read_bytes"],
              "decode_disk_read_bytes": after["read_bytes"] - decoding.get("io", before)["read_bytes"],
              "steady_tokens": steady["tokens"],
              "steady_disk_read_bytes": after["read_bytes"] - decoding["steady"]["read_bytes"]
              if "steady" in decoding else None,
              "rchar": after["rchar"] - before["rchar"], "tokens": out[0].tolist(),
              "peak_rss": _status("VmHWM"), "ggml_threads": ggml_threads(), "tier": tier,
              "host_memory": cache.host_mode[0], "cpu_graph": cache.cpu_graph}
    print("RESULT " + json.dumps(result), flush=True)


def _io() -> dict:
    return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def run(model: Path, label: str, settings: dict, tokens: int, threads: int, cgroup: Path | None,
        front: dict | None = None) -> dict:
    """One configuration in a child process; ``front``: {"device", "slots"} (default: the CPU engine, resident)."""
    _drop_caches()
    spec = {"model": str(model), "label": label, "settings": settings, "tokens": tokens, "threads": threads,
            "cgroup": None if cgroup is None else str(cgroup), **(front or {})}
    if cgroup is not None:
        (cgroup / "memory.max_usage_in_bytes").write_text("0")
        (cgroup / "memory.failcnt").write_text("0")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        oom = " (killed: out of memory in the cgroup?)" if proc.returncode in (-9, 137) else ""
        tail = "\n".join(proc.stderr.splitlines()[-6:])
        return {"label": label, "error": f"exit {proc.returncode}{oom}: {tail}"}
    result = json.loads(lines[-1][len("RESULT "):])
    if cgroup is not None:
        result["cgroup_max_usage"] = int((cgroup / "memory.max_usage_in_bytes").read_text())
        result["cgroup_failcnt"] = int((cgroup / "memory.failcnt").read_text())
    return result


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def make_cgroup(name: str, limit: int) -> tuple[Path | None, str]:
    path = CGROUP / name
    try:
        path.mkdir(exist_ok=True)
        (path / "memory.limit_in_bytes").write_text(str(limit))
        got = int((path / "memory.limit_in_bytes").read_text())
        return path, f"cgroup v1 {path}, memory.limit_in_bytes {got}"
    except OSError as err:
        return None, f"no memory cgroup ({err}); runs unlimited, counters still reported"


# -- the table ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="/tmp/tiers-bench", help="where the model is built (kept)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slack", default="128MiB", help="added to the calibration peak RSS for the limit")
    ap.add_argument("--limit", help="one cgroup limit for every pair (bytes or 1GiB); default: calibrated "
                    "per tier budget")
    ap.add_argument("--shares", type=int, nargs="+", default=[25, 50], help="tier budgets, %% of the experts")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every configuration (best one shown)")
    ap.add_argument("--per-layer", action="store_true", help="also run each tier on the per-layer path "
                    "(cpu_graph='off'): before and after the one-graph decode, side by side")
    ap.add_argument("--rows-plain", action="store_true", help="also run each tier with its rows the file's "
                    "bytes (cpu_repack='off'; by default they hold ggml's repacked layout)")
    ap.add_argument("--no-read-ahead", action="store_true", help="also run each tier with the router read-ahead "
                    "off (runtime/ggmltier.py Prefetch): what reading the next layer's guessed experts buys")
    ap.add_argument("--device", default="cpu", help="cpu (the CPU engine, every expert from the host) or "
                    "cuda (device slots in front of the host tier: give --slots)")
    ap.add_argument("--slots", type=int, help="device slots as a %% of the experts, in front of every configuration")
    ap.add_argument("--no-warm-up", action="store_true", help="calibrate without a warm-up run first (the "
                    "numba cache already compiled, as gpu_check.sh's earlier steps leave it)")
    ap.add_argument("--layer-update", type=float, default=1.0, help="scale of what each layer adds to the "
                    "residual stream (below 1: less locality token to token, more reads; a model of its own)")
    ap.add_argument("--shared", type=float, default=0.0, help="a direction shared by every token's embedding, "
                    "this many times a token's own norm (the tokens route more alike; a model of its own)")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if not args.layer_update > 0:
        ap.error(f"--layer-update must be above 0 (1: the default model), got {args.layer_update}")
    if args.device == "cuda" and not args.slots:
        ap.error("--device cuda needs --slots (the device slots in front of the host tier)")
    from expertcache.ggufmodel.header import read_header
    from expertcache.sizes import format_size, parse_size

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    model = model_path(folder, args.layer_update, args.shared)
    if not model.exists():
        print(f"building {model} ...", flush=True)
        build_model(model, update=args.layer_update, shared=args.shared)
    header = read_header(model)
    experts_bytes, file_bytes = header.experts_bytes, model.stat().st_size
    print(f"model {model}: {format_size(file_bytes)}, experts {format_size(experts_bytes)} "
          f"({header.num_experts} x {len(header.moe_blocks)} layers, {format_size(header.expert_bytes)} each)")
    bandwidth = _bandwidth(model, file_bytes)
    print(f"O_DIRECT read bandwidth {bandwidth / 1e9:.2f} GB/s (4 threads, 512 KiB blocks, whole file)", flush=True)
    ref_settings = dict(host_memory="copy")
    front = {"device": args.device}
    if args.slots:
        front["slots"] = max(header.top_k, round(args.slots / 100 * len(header.moe_blocks) * header.num_experts))
        print(f"{args.device}: {front['slots']} device slots ({args.slots}% of the experts) in front of every run")
    limits = {}
    if not args.limit and not args.no_warm_up:  # a fresh checkout's first process compiles numba's kernels and Python's
        # bytecode: 115-185 MiB more peak RSS (890-961 against 775 MiB, EPYC sandbox), which
        # would widen the limit and hand mmap's page cache the difference
        warm = run(model, "warm-up: caches compiled, no limit", _tier(args.shares[0]), 4, args.threads, None, front)
        print(f"warm-up: {warm['error'] if 'error' in warm else 'peak RSS ' + format_size(warm['peak_rss'])} "
              "(not used)", flush=True)
    for share in args.shares:  # the limit each tier fits in: its peak RSS without a limit, plus the slack
        if args.limit:
            limit = parse_size(args.limit)
        else:
            cal = run(model, f"calibration: tiered {share}%, no limit", _tier(share), 4, args.threads, None, front)
            limit = cal["peak_rss"] + parse_size(args.slack)
            print(f"calibration tiered {share}%: peak RSS {format_size(cal['peak_rss'])} -> limit "
                  f"{format_size(limit)}", flush=True)
        limits[share] = {"limit": limit}
    # the runs with ggml's plain kernels (cpu_repack='off': mmap, rows plain) against the tokens of
    # an all-in-RAM run with the same kernels: the repacked kernels sum in another order (logits
    # 1e-3 apart on an AVX-512 EPYC), and a sampled decode can then draw another token
    plain_ref = run(model, "copy, plain kernels (tokens only)", dict(ref_settings, cpu_repack="off"), args.tokens,
                    args.threads, None, front) if args.device == "cpu" else None
    if plain_ref is not None:
        print(f"plain kernels, all in RAM: {plain_ref.get('error') or format(plain_ref['tok_s'], '.2f') + ' tok/s'} "
              "(the tokens the cpu_repack='off' runs are checked against)", flush=True)
    rounds = []
    for rnd in range(args.repeats):  # interleaved: load from other processes hits every config alike
        bw_before = _bandwidth(model, file_bytes)  # the drive's rate drifts too (0.94-1.26 GB/s, one hour)
        ref = run(model, "copy (all in RAM, reference)", ref_settings, args.tokens, args.threads, None, front)
        print(f"round {rnd + 1}: reference {ref.get('tok_s', 0):.2f} tok/s, peak RSS "
              f"{format_size(ref.get('peak_rss', 0))}", flush=True)
        runs = []
        for share in args.shares:
            limit = limits[share]["limit"]
            cgroup, cg_text = make_cgroup("expertcache-tiers", limit)
            limits[share]["cgroup"] = cg_text
            # mmap reads its experts in place through the page cache (cpu_repack='auto' would copy every
            # expert into RAM for ggml's repacked kernels: it sizes by free RAM, not the cgroup's limit)
            configs = [(f"mmap ({share}% limit)", dict(host_memory="mmap", cpu_repack="off")),
                       (f"tiered {share}%", _tier(share))]
            if args.rows_plain:
                configs.append((f"tiered {share}% rows plain", dict(_tier(share), cpu_repack="off")))
            if args.per_layer:
                configs.append((f"tiered {share}% per-layer", dict(_tier(share), cpu_graph="off")))
            if args.no_read_ahead:
                configs.append((f"tiered {share}% no read-ahead", dict(_tier(share), read_ahead=False)))
            for label, settings in configs:
                r = run(model, label, settings, args.tokens, args.threads, cgroup, front)
                r.update(limit=limit, pair=share, round=rnd + 1, plain_kernels=settings.get("cpu_repack") == "off")
                runs.append(r)
        # the reference again after the round's runs: the machine's speed drifts (other sessions'
        # work); the round's all-in-RAM speed is the mean of the runs before and after
        after = run(model, "copy (all in RAM, reference)", ref_settings, args.tokens, args.threads, None, front)
        ref = _bracket(ref, after)
        bw_after = _bandwidth(model, file_bytes)
        round_bw = (bw_before + bw_after) / 2
        print(f"round {rnd + 1}: reference after {after.get('tok_s', 0):.2f} tok/s; all in RAM "
              f"{ref.get('tok_s', 0):.2f} tok/s (mean); O_DIRECT {bw_before / 1e9:.2f} GB/s before, "
              f"{bw_after / 1e9:.2f} after", flush=True)
        for r in runs:
            _score(r, ref, round_bw, plain_ref if r.get("plain_kernels") and plain_ref else None)
            print(_line(r, format_size), flush=True)
        rounds.append({"reference": ref, "runs": runs, "odirect_bandwidth": round_bw,
                       "odirect_bandwidth_before_after": [bw_before, bw_after]})
    # per configuration, its fastest round (the least disturbed by other processes)
    best = {}
    for rnd in rounds:
        for r in rnd["runs"]:
            if "error" not in r and (r["label"] not in best or r["tok_s"] > best[r["label"]]["tok_s"]):
                best[r["label"]] = r
    rows = [best[label] for label in dict.fromkeys(r["label"] for rnd in rounds for r in rnd["runs"])
            if label in best]
    ref = max((rnd["reference"] for rnd in rounds), key=lambda r: r.get("tok_s", 0))
    doc = {"machine": _machine(), "load_before": os.getloadavg(), **front, "model": str(model),
           "layer_update": args.layer_update, "shared": args.shared, "file_bytes": file_bytes,
           "experts_bytes": experts_bytes, "shape": SHAPE, "odirect_bandwidth": bandwidth,
           "limits": limits, "tokens": args.tokens, "threads": args.threads, "plain_reference": plain_ref,
           "reference": ref, "runs": rows, "rounds": rounds, "repeats": args.repeats, "uptime": subprocess.run(["uptime"], capture_output=True,
                                                                       text=True).stdout.strip()}
    mm = next((r for r in rows if r["label"].startswith("mmap") and r["pair"] == 25 and "error" not in r), None)
    t25 = next((r for r in rows if r["label"] == "tiered 25%" and "error" not in r), None)
    if mm and t25:
        doc["goals"] = {"speedup_25_vs_mmap": t25["tok_s"] / mm["tok_s"],
                        "disk_bytes_ratio_25_vs_mmap": t25["disk_bytes_per_token"] / mm["disk_bytes_per_token"]
                        if mm["disk_bytes_per_token"] else None,
                        "of_bound_25": t25["of_bound"], "of_bound_25_steady": t25.get("of_bound_steady"),
                        "tokens_equal": all(r.get("tokens_equal_reference") for rnd in rounds for r in rnd["runs"])}
        per_round = []  # the same ratios side by side within each round
        for rnd in rounds:
            by = {r["label"]: r for r in rnd["runs"] if "error" not in r}
            a, b, c = by.get("tiered 25%"), by.get("mmap (25% limit)"), by.get("tiered 25% per-layer")
            plain = by.get("tiered 25% rows plain")
            blind = by.get("tiered 25% no read-ahead")
            if a and b:
                per_round.append({"speedup_25_vs_mmap": a["tok_s"] / b["tok_s"],
                                  "disk_bytes_ratio_25_vs_mmap": a["disk_bytes_per_token"] / b["disk_bytes_per_token"],
                                  "of_bound_25": a["of_bound"], "of_disk_bound_25": a["of_disk_bound"],
                                  "of_bound_25_steady": a.get("of_bound_steady"),
                                  "of_serial_bound_25": a.get("of_serial_bound"),
                                  **({"graph_vs_per_layer_25": a["tok_s"] / c["tok_s"]} if c else {}),
                                  **({"repacked_vs_plain_rows_25": a["tok_s"] / plain["tok_s"]} if plain else {}),
                                  **({"read_ahead_vs_none_25": a["tok_s"] / blind["tok_s"]} if blind else {})})
        doc["goals"]["per_round"] = per_round
        print("goals:", json.dumps(doc["goals"]))
    print(doc["uptime"])
    _table(rows, format_size)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.png:
        _plot(doc, Path(args.png))


def _bracket(before: dict, after: dict) -> dict:
    """The reference runs before and after a round's runs as one: their mean tok/s (both kept)."""
    if "error" in before or "error" in after:
        return before if "error" in after else after
    if before["tokens"] != after["tokens"]:
        raise SystemExit("the all-in-RAM runs before and after a round gave different tokens: not deterministic")
    steady = None if None in (before.get("steady_tok_s"), after.get("steady_tok_s")) else \
        (before["steady_tok_s"] + after["steady_tok_s"]) / 2
    return {**before, "tok_s": (before["tok_s"] + after["tok_s"]) / 2, "steady_tok_s": steady,
            "tok_s_before": before["tok_s"], "tok_s_after": after["tok_s"]}


def _bandwidth(model: Path, file_bytes: int) -> float:
    """The drive's O_DIRECT read rate on the model file, the page cache dropped first."""
    from expertcache.runtime.directio import read_bandwidth
    _drop_caches()
    return read_bandwidth(model, limit=file_bytes)


def _tier(share: int) -> dict:
    return dict(host_memory="tiered", host_budget=f"{share}%")


def _score(r: dict, ref: dict, bandwidth: float, same_kernels: dict | None = None) -> None:
    """Disk bytes per decode token (read by the decode forwards; with the prompt's reads too:
    ``all_disk_bytes_per_token``), the bounds against the round's all-in-RAM speed, the RAM hit rate;
    tokens against ``same_kernels``' where given (an all-in-RAM run with the run's own kernels), else ``ref``'s."""
    if "error" in r:
        return
    r["disk_bytes_per_token"] = r["decode_disk_read_bytes"] / r["decode_tokens"]
    r["all_disk_bytes_per_token"] = r["disk_read_bytes"] / r["decode_tokens"]
    # the run cannot beat the all-in-RAM run's compute either: the bound is the lower of the two
    r["disk_bound_tok_s"], r["bound_tok_s"] = _bounds(bandwidth, r["disk_bytes_per_token"], ref.get("tok_s"))
    r["all_in_ram_tok_s"] = ref.get("tok_s")
    r["of_disk_bound"] = r["tok_s"] / r["disk_bound_tok_s"] if r["disk_bound_tok_s"] else None
    r["of_bound"] = r["tok_s"] / r["bound_tok_s"]
    # what a step can reach when its reads start at its routing and none is guessed ahead: the
    # all-in-RAM time plus the disk time, end to end (the plan's cost model, docs/tiers.md "plan")
    r["serial_bound_tok_s"] = 1 / (1 / ref["tok_s"] + (1 / r["disk_bound_tok_s"] if r["disk_bound_tok_s"] else 0)) \
        if ref.get("tok_s") else None
    r["of_serial_bound"] = r["tok_s"] / r["serial_bound_tok_s"] if r["serial_bound_tok_s"] else None
    # the same past the decode's first quarter (decode_phases.py 'steady'): its own disk bytes,
    # against the reference's steady speed
    r["of_bound_steady"] = None
    if r.get("steady_tok_s") and ref.get("steady_tok_s") and r.get("steady_disk_read_bytes") is not None:
        per_token = r["steady_disk_read_bytes"] / r["steady_tokens"]
        r["of_bound_steady"] = r["steady_tok_s"] / _bounds(bandwidth, per_token, ref["steady_tok_s"])[1]
    r["tokens_equal_reference"] = r["tokens"] == (same_kernels or ref).get("tokens")
    r["tokens_reference"] = "all in RAM, plain kernels" if same_kernels else "all in RAM"
    r["ram_hit_rate"] = ram_hit_rate(r)


def ram_hit_rate(r: dict) -> float | None:
    """A run's decode RAM hit rate from its tier counters (None without a tier or accesses)."""
    d = (r.get("tier") or {}).get("decode", {})
    return d["ram_hits"] / d["accesses"] if d.get("accesses") else None


def _bounds(bandwidth: float, bytes_per_token: float, ram_tok_s: float | None) -> tuple:
    """(disk bound, the lower of it and the all-in-RAM speed) in tok/s; no bytes: no disk bound."""
    disk = bandwidth / bytes_per_token if bytes_per_token else None
    return disk, min(b for b in (disk, ram_tok_s) if b)


def _line(r: dict, format_size) -> str:
    if "error" in r:
        return f"{r['label']}: {r['error']}"
    hit = "-" if r["ram_hit_rate"] is None else f"{r['ram_hit_rate']:.3f}"
    ahead = (r["tier"] or {}).get("prefetch")
    ahead = "" if not ahead else f", read ahead {ahead['read_ahead']} experts ({ahead['used']} used)"
    return (f"{r['label']} (limit {format_size(r['limit'])}, graph {r.get('cpu_graph')}{ahead}): {r['tok_s']:.2f} tok/s, "
            f"{format_size(r['disk_bytes_per_token'])} from disk per token, RAM hits {hit}, "
            f"{r['of_disk_bound']:.2f} of the disk bound, {r['of_bound']:.2f} of min(disk, all-in-RAM)"
            + ("" if r.get("of_bound_steady") is None else f" ({r['of_bound_steady']:.2f} past the first quarter)")
            + ("" if r.get("of_serial_bound") is None else f", {r['of_serial_bound']:.2f} of all-in-RAM + disk time")
            + f", tokens equal: {r['tokens_equal_reference']}")


def _table(rows: list[dict], format_size) -> None:
    # of disk: tok/s over the disk bound; of bound: over min(disk bound, all-in-RAM tok/s); steady:
    # the same past the cold start and warm-up (decode_phases.py); of serial: over the all-in-RAM
    # time plus the disk time (reads that start at their step's routing)
    print(f"{'config':<28}{'graph':>6}{'limit':>12}{'tok/s':>8}{'disk/token':>14}{'RAM hits':>10}"
          f"{'disk bound':>12}{'of disk':>9}{'of bound':>10}{'steady':>8}{'of serial':>10}{'peak cgroup':>13}")
    for r in rows:
        if "error" in r:
            print(f"{r['label']:<28} error")
            continue
        hit = "-" if r["ram_hit_rate"] is None else f"{r['ram_hit_rate']:.3f}"
        print(f"{r['label']:<28}{r.get('cpu_graph', '?'):>6}{format_size(r['limit']):>12}{r['tok_s']:>8.2f}"
              f"{format_size(r['disk_bytes_per_token']):>14}{hit:>10}{r['disk_bound_tok_s'] or 0:>12.1f}"
              f"{r['of_disk_bound'] or 0:>9.2f}{r['of_bound']:>10.2f}{r.get('of_bound_steady') or 0:>8.2f}"
              f"{r.get('of_serial_bound') or 0:>10.2f}{format_size(r.get('cgroup_max_usage', 0)):>13}")


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') >> 30} GiB"


def _plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = doc["rounds"]
    labels = [r["label"] for r in rounds[0]["runs"]]
    width = 0.8 / len(rounds)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, rnd in enumerate(rounds):  # each round side by side: ratios hold within a round
        by = {r["label"]: r for r in rnd["runs"] if "error" not in r}
        xs = [j + (i - (len(rounds) - 1) / 2) * width for j in range(len(labels))]
        colors = ["tab:gray" if lab.startswith("mmap") else "tab:blue" for lab in labels]
        a.bar(xs, [by[lab]["tok_s"] if lab in by else 0 for lab in labels], width, color=colors,
              alpha=1.0 - 0.35 * i, edgecolor="k", lw=0.5)
        a.hlines(rnd["reference"]["tok_s"], xs[0] - width / 2, xs[-1] + width / 2, colors="k", ls="--", lw=1,
                 label="all in RAM (no limit), per round" if i == 0 else None)
        b.bar(xs, [by[lab]["disk_bytes_per_token"] / 2**20 if lab in by else 0 for lab in labels], width,
              color=colors, alpha=1.0 - 0.35 * i, edgecolor="k", lw=0.5)
    for ax in (a, b):
        ax.set_xticks(range(len(labels)), [lab.replace(" (", "\n(") for lab in labels], fontsize=8)
    a.set_ylabel(f"decode tok/s (rounds 1..{len(rounds)}, left to right)")
    a.legend(fontsize=8)
    b.set_ylabel("MiB read from disk per decode token")
    limits = ", ".join(f"{k}%: {v['limit'] / 2**20:.0f} MiB" for k, v in doc["limits"].items())
    update, shared = doc.get("layer_update", 1), doc.get("shared", 0)
    fig.suptitle(f"{doc['machine']}; load {doc['load_before'][0]:.1f}; cgroup limits {limits}; file "
                 f"{doc['file_bytes'] / 2**20:.0f} MiB" + ("" if update == 1 else f" (layer update {update:g})")
                 + (f" (shared embedding {shared:g})" if shared else "")
                 + f"; O_DIRECT {doc['odirect_bandwidth'] / 1e9:.2f} GB/s",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
