"""A model larger than the machine's RAM, decoded on the CPU: the RAM tier against mmap (issue 33).

``bench_tiers.py`` makes a small model larger than a memory cgroup's limit. This one takes the
case users have: a GGUF larger than all of the machine's memory, no cgroup. It builds (once,
kept in ``--dir``) a GGUF of Qwen3-30B-A3B's shape: 48 layers, 128 experts of 768 x 2048, top-8,
hidden 2048, 32 query and 4 KV heads of 128, every weight but the norms and routers random
Q8_0 (the real Q8_0 file is 32.5 GB; this one, with a 260-token vocabulary, 31.8 GB). It
refuses to run where the file fits in RAM. Each configuration is a process of its own
(``bench_tiers.child``), started after the page cache is dropped:

- ``mmap``: ``host_memory='mmap'``, ``cpu_repack='off'``: the experts read in place through the
  page cache, which may use all the memory the machine has free (llama.cpp's default);
- ``tiered N% plain``: a RAM tier of N% of the experts, its rows the file's bytes
  (``cpu_repack='off'``): ggml's kernels are then mmap's, so its tokens must equal mmap's;
- ``tiered N%``: the same tier, its rows in ggml's repacked layout (the default);
- ``tiered auto`` (``--auto``): ``host_budget='auto'``, the RAM free at load less the dense
  weights and a margin (runtime/tiered.py ``auto_rows``).

Reported per run: load seconds, prompt seconds (8 tokens), decode tok/s over ``--tokens``
sampled tokens (seeded) and past their first quarter, bytes read from disk per decode token
(``/proc/self/io`` ``read_bytes``), peak RSS, the tier's RAM hit rate, whether the tokens equal
mmap's. No all-in-RAM run is possible here (that is the point), so the disk bound is the one
figure to score against: disk bytes per token over the drive's ``O_DIRECT`` rate. Without a
cgroup mmap's page cache takes what RAM is free, the tier its budget; ``--limit 10GiB`` puts
every run in one memory cgroup (v1, root), so that both have the same RAM.

    flock /tmp/bench.lock python benchmarks/bench_beyond_ram.py --dir /tmp/tiers-bench --tokens 32 \
        --json benchmarks/results/bench_beyond_ram.json --png benchmarks/results/bench_beyond_ram.png

Building writes the whole file once (about a minute on a drive writing 1 GB/s); it needs that
much free disk and is kept for the next run (``--remove`` deletes it at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))  # gguf_models: the tokenizer lists and metadata writer

import bench_tiers  # noqa: E402  (its child process, cache drop and bandwidth probe)

# Qwen3-30B-A3B's config.json, but its vocabulary (the byte-level test tokenizer's)
SHAPE = dict(hidden=2048, layers=48, experts=128, top_k=8, expert_ff=768, heads=32, kv_heads=4, head_dim=128)
# value spreads of the random weights: transformers' init (0.02) for the dense projections;
# the embedding's and routers' as bench_tiers' model (a token's own direction counts, routing
# varies from token to token); the experts' so that a layer's output stays of the input's order
STD = dict(dense=0.02, embed=bench_tiers.EMBED_STD, router=bench_tiers.ROUTER_STD, expert=0.01)
_Q8 = 34  # bytes of a Q8_0 block: an fp16 scale and 32 int8


def model_path(folder: Path, update: float = 1.0) -> Path:
    return folder / ("qwen3moe-30b-a3b-shape-q8_0" + ("" if update == 1 else f"-update{update:g}") + ".gguf")


def _q8_0(rng, shape: tuple, std: float):
    """Random Q8_0 blocks of a [..., rows, cols] weight whose values spread ``std``: uint8
    [..., rows, cols / 32 * 34] (uniform int8 quants, one scale)."""
    import numpy as np

    *lead, cols = shape
    n = int(np.prod(lead)) * (cols // 32) * _Q8
    raw = rng.integers(0, 2**64 - 1, -(-n // 8), dtype=np.uint64, endpoint=True).view(np.uint8)[:n]
    blocks = raw.reshape(-1, _Q8)
    blocks[:, :2] = np.array([std / 73.9], np.float16).view(np.uint8)  # uniform int8 spreads 73.9
    return blocks.reshape(*lead, cols // 32 * _Q8)


def _tensors(vocab: int, update: float = 1.0) -> list[tuple[str, tuple, str, float]]:
    """(GGUF name, [..., rows, cols], type, std) of every tensor, in file order; ``update`` scales
    what each layer adds to the residual stream (attention's output, the experts' down), as
    ``bench_tiers.build_model``'s does."""
    s = SHAPE
    H, E, I = s["hidden"], s["experts"], s["expert_ff"]
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]  # query and key/value widths
    out = [("token_embd.weight", (vocab, H), "Q8_0", STD["embed"])]
    for b in range(s["layers"]):
        p = f"blk.{b}."
        out += [(p + "attn_norm.weight", (H,), "F32", 1.0), (p + "attn_q.weight", (q, H), "Q8_0", STD["dense"]),
                (p + "attn_k.weight", (kv, H), "Q8_0", STD["dense"]),
                (p + "attn_v.weight", (kv, H), "Q8_0", STD["dense"]),
                (p + "attn_output.weight", (H, q), "Q8_0", STD["dense"] * update),
                (p + "attn_q_norm.weight", (s["head_dim"],), "F32", 1.0),
                (p + "attn_k_norm.weight", (s["head_dim"],), "F32", 1.0),
                (p + "ffn_norm.weight", (H,), "F32", 1.0), (p + "ffn_gate_inp.weight", (E, H), "F32", STD["router"]),
                (p + "ffn_gate_exps.weight", (E, I, H), "Q8_0", STD["expert"]),
                (p + "ffn_up_exps.weight", (E, I, H), "Q8_0", STD["expert"]),
                (p + "ffn_down_exps.weight", (E, H, I), "Q8_0", STD["expert"] * update)]
    return out + [("output_norm.weight", (H,), "F32", 1.0), ("output.weight", (vocab, H), "Q8_0", STD["dense"])]


def _array(rng, shape: tuple, kind: str, std: float):
    import numpy as np

    if kind == "Q8_0":
        return _q8_0(rng, shape, std)
    if std == 1.0:  # a norm's weight
        return np.ones(shape, np.float32)
    return rng.normal(0, std, shape).astype(np.float32)


def build_model(path: Path, seed: int = 0, update: float = 1.0) -> Path:
    """The GGUF, written tensor by tensor (one expert tensor, 214 MB, in memory at a time)."""
    import gguf
    import numpy as np
    import transformers as tf

    from gguf_models import _metadata, tokenizer_lists

    s = SHAPE
    vocab = len(tokenizer_lists()[0])
    cfg = tf.Qwen3MoeConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                            num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], vocab_size=vocab,
                            intermediate_size=6144, moe_intermediate_size=s["expert_ff"], num_experts=s["experts"],
                            num_experts_per_tok=s["top_k"], decoder_sparse_step=1, norm_topk_prob=True,
                            max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                            tie_word_embeddings=False, bos_token_id=vocab - 2, eos_token_id=vocab - 2)
    tmp = path.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), "qwen3moe")
    _metadata(writer, cfg, "qwen3moe", True)
    tensors = _tensors(vocab, update)
    for name, shape, kind, _ in tensors:
        if kind == "Q8_0":
            byte_shape = (*shape[:-1], shape[-1] // 32 * _Q8)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    t0, done, total = time.perf_counter(), 0, len(tensors)
    for i, (name, shape, kind, std) in enumerate(tensors):
        writer.write_tensor_data(_array(rng, shape, kind, std))
        if name.endswith("down_exps.weight"):
            done = i + 1
            print(f"\r  written {done}/{total} tensors, {tmp.stat().st_size / 1e9:.1f} GB, "
                  f"{time.perf_counter() - t0:.0f} s", end="", flush=True)
    writer.close()
    print()
    tmp.rename(path)  # only a whole file takes the name: an interrupted build starts over
    return path


def _memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _score(r: dict, bandwidth: float, mmap_tokens: list | None) -> None:
    decode = r["decode_tokens"]
    r["disk_bytes_per_token"] = r["decode_disk_read_bytes"] / decode
    r["disk_bound_tok_s"] = bandwidth / r["disk_bytes_per_token"] if r["disk_bytes_per_token"] else None
    r["of_disk_bound"] = r["tok_s"] / r["disk_bound_tok_s"] if r["disk_bound_tok_s"] else None
    r["ram_hits"] = bench_tiers.ram_hit_rate(r)
    r["tokens_equal_mmap"] = None if mmap_tokens is None else r["tokens"] == mmap_tokens


def _table(runs: list[dict], format_size) -> None:
    print(f"{'round':>5} {'config':22}{'load s':>8}{'prompt s':>10}{'tok/s':>8}{'steady':>8}{'disk/token':>13}"
          f"{'RAM hits':>10}{'of disk bound':>15}{'peak RSS':>12}{'= mmap':>8}")
    for r in runs:
        if "error" in r:
            print(f"{r['round']:>5} {r['label']:22} {r['error']}")
            continue
        hits = "-" if r["ram_hits"] is None else f"{r['ram_hits']:.3f}"
        eq = "-" if r["tokens_equal_mmap"] is None else str(r["tokens_equal_mmap"])
        print(f"{r['round']:>5} {r['label']:22}{r['load_s']:>8.1f}{r['prefill_s']:>10.1f}{r['tok_s']:>8.2f}"
              f"{r.get('steady_tok_s') or 0:>8.2f}{format_size(r['disk_bytes_per_token']):>13}{hits:>10}"
              f"{r['of_disk_bound'] or 0:>15.2f}{format_size(r['peak_rss']):>12}{eq:>8}")


def _plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in doc["runs"] if "error" not in r]
    labels = [f"{r['label']}\nround {r['round']}" for r in runs]  # rounds side by side
    colors = ["tab:gray" if lab.startswith("mmap") else "tab:blue" for lab in labels]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 5))
    a.bar(labels, [r["tok_s"] for r in runs], color=colors, edgecolor="k", lw=0.5)
    a.set_ylabel("decode tok/s")
    b.bar(labels, [r["disk_bytes_per_token"] / 2**20 for r in runs], color=colors, edgecolor="k", lw=0.5)
    b.set_ylabel("MiB read from disk per decode token")
    c.bar(labels, [r["peak_rss"] / 2**30 for r in runs], color=colors, edgecolor="k", lw=0.5)
    c.axhline(doc["memory"] / 2**30, color="k", ls="--", lw=1, label="the machine's RAM")
    c.axhline(doc["file_bytes"] / 2**30, color="tab:red", ls=":", lw=1, label="the model file")
    c.set_ylabel("peak RSS, GiB")
    c.legend(fontsize=8)
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelsize=7, rotation=60)
    update = doc.get("layer_update", 1)
    fig.suptitle(f"{doc['machine']}; {doc['file_bytes'] / 1e9:.1f} GB GGUF (Qwen3-30B-A3B shape, Q8_0"
                 + ("" if update == 1 else f", layer update {update:g}") + "); "
                 + (f"cgroup limit {doc['limit'] / 2**30:.1f} GiB; " if doc.get("limit") else "no cgroup; ")
                 + f"O_DIRECT {doc['odirect_bandwidth'] / 1e9:.2f} GB/s; {doc['tokens']} sampled tokens", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/tiers-bench", help="where the model is built (kept)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shares", type=int, nargs="+", default=[50], help="tier budgets, %% of the experts")
    ap.add_argument("--auto", action="store_true", help="also run the tier at host_budget='auto' (the free "
                    "RAM less the dense weights and a margin)")
    ap.add_argument("--no-plain", action="store_true", help="skip the tiers with plain rows (the tokens check)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every configuration, interleaved")
    ap.add_argument("--layer-update", type=float, default=1.0, help="scale of what each layer adds to the "
                    "residual stream (bench_tiers.py's; 0.1: consecutive tokens share about as many experts "
                    "as the real Qwen3-30B-A3B traces; a model of its own)")
    ap.add_argument("--limit", help="put every run in one memory cgroup of this size (e.g. 10GiB): mmap and "
                    "the tier in the same RAM, bench_tiers.py's comparison at this model's scale")
    ap.add_argument("--allow-fits", action="store_true", help="run even where the file fits in RAM")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--remove", action="store_true", help="delete the model file at the end")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args()
    from expertcache.ggufmodel.header import read_header
    from expertcache.sizes import format_size, parse_size

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    model = model_path(folder, args.layer_update)
    if not model.exists():
        print(f"building {model} ...", flush=True)
        build_model(model, update=args.layer_update)
    if args.build_only:
        return
    header, file_bytes, memory = read_header(model), model.stat().st_size, _memory()
    print(f"model {model}: {format_size(file_bytes)}, experts {format_size(header.experts_bytes)} "
          f"({header.num_experts} x {len(header.moe_blocks)} layers, {format_size(header.expert_bytes)} each); "
          f"this machine: {format_size(memory)} of RAM", flush=True)
    if file_bytes <= memory and not args.allow_fits:
        raise SystemExit(f"the model ({format_size(file_bytes)}) fits in this machine's RAM "
                         f"({format_size(memory)}): nothing to show (--allow-fits runs it anyway)")
    bandwidth = bench_tiers._bandwidth(model, 2 << 30)
    print(f"O_DIRECT read bandwidth {bandwidth / 1e9:.2f} GB/s (4 threads, 512 KiB blocks, first 2 GiB)", flush=True)
    load = os.getloadavg()
    cgroup, limit_note = None, "no cgroup"
    if args.limit:
        cgroup, limit_note = bench_tiers.make_cgroup("expertcache-beyond-ram", parse_size(args.limit))
        print(limit_note, flush=True)
    configs = [("mmap", dict(host_memory="mmap", cpu_repack="off"))]
    for share in args.shares:
        if not args.no_plain:
            configs.append((f"tiered {share}% plain", dict(bench_tiers._tier(share), cpu_repack="off")))
        configs.append((f"tiered {share}%", bench_tiers._tier(share)))
    if args.auto:
        configs.append(("tiered auto", dict(host_memory="tiered", host_budget="auto")))
    runs = []
    for round_ in range(1, args.repeats + 1):
        mmap_tokens = None
        for label, settings in configs:
            print(f"round {round_}: {label} ...", flush=True)
            r = bench_tiers.run(model, label, settings, args.tokens, args.threads, cgroup)
            r["round"] = round_
            if "error" not in r:
                if label == "mmap":
                    mmap_tokens = r["tokens"]
                _score(r, bandwidth, None if label == "mmap" else mmap_tokens)
            print(f"  {r.get('error') or format(r['tok_s'], '.2f') + ' tok/s'}", flush=True)
            runs.append(r)
    _table(runs, format_size)
    doc = {"machine": bench_tiers._machine(), "memory": memory, "file_bytes": file_bytes, "shape": SHAPE,
           "limit": parse_size(args.limit) if cgroup is not None else None, "cgroup": limit_note,
           "layer_update": args.layer_update, "odirect_bandwidth": bandwidth, "tokens": args.tokens,
           "threads": args.threads, "load_before": load, "load_after": os.getloadavg(), "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.png:
        _plot(doc, Path(args.png))
    if args.remove:
        model.unlink()


if __name__ == "__main__":
    main()
