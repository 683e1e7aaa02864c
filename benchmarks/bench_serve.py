"""Serving on the CPU: requests/s and per-request decode tok/s at 1, 2 and 4 concurrent clients.

A small random Qwen3-MoE (hidden 256, 4 MoE layers, 32 experts, top-4) with a word-level
tokenizer is saved to a temporary directory and served three ways, one after the other:

* ``expertcache``: ``expertcache serve``'s server, the model loaded by ``offload(path)``
  with half of the experts in slots (default policy, miss path fetch);
* ``uncached``: the same server over the plain model (``from_pretrained``), no cache;
* ``transformers``: ``transformers serve`` (its FastAPI app) pinned to the same directory,
  when its dependencies (fastapi, uvicorn, openai) are installed.

Each client sends streamed completions one after the other (greedy, fixed prompt length,
``--max-tokens`` new tokens; the model has no end token, so every answer is full length).
Per request: time to first text, decode tok/s = (tokens - 1) / (last text - first text),
tokens as the server's usage reports them. All three servers run one generation
at a time, so requests/s stays flat as clients are added and latency grows instead.

    .venv/bin/python benchmarks/bench_serve.py [--max-tokens 32] [--requests 4] [--threads 2]

Writes benchmarks/results/serve_cpu.json (machine, settings, figures per server and level).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers as tf

RESULTS = Path(__file__).resolve().parent / "results" / "serve_cpu.json"
LEVELS = (1, 2, 4)
VOCAB = 512


def save_model(path: Path, seed: int = 0) -> None:
    """A random small MoE plus a word-level tokenizer (w0 ... w508), saved as a checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = tf.Qwen3MoeConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
                            intermediate_size=512, decoder_sparse_step=1, vocab_size=VOCAB,
                            max_position_embeddings=512, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # varied routing, as a trained router gives
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="<pad>", bos_token="<s>",
                                      eos_token="</s>")
    fast.save_pretrained(path)


# -- servers: each is (start() -> base url, stop()) ---------------------------------------
class OurServer:
    def __init__(self, path: Path, cached: bool) -> None:
        from expertcache.config import CacheConfig
        from expertcache.integrations.transformers import offload
        from expertcache.loaders import load_tokenizer
        from expertcache.loaders.checkpoint import load_checkpoint
        from expertcache.serve import Server, ServeSettings

        tokenizer = load_tokenizer(path)
        if cached:  # as `expertcache serve` loads it
            model = offload(path, config=CacheConfig(slots=4 * 32 // 2, device="cpu")).eval()
        else:
            model = load_checkpoint(path, None).eval()
        self.model = model
        self.server = Server(model, tokenizer, ServeSettings(path.name, port=0, max_tokens=4096))

    def start(self) -> str:
        return self.server.start()

    def stop(self) -> None:
        self.server.stop()


class TransformersServer:
    """``transformers serve`` pinned to the checkpoint, in this process (its non_blocking mode)."""

    def __init__(self, path: Path) -> None:
        from transformers.cli.serve import Serve

        self.port = free_port()
        self.serve = Serve(force_model=str(path), device="cpu", dtype="float32", host="127.0.0.1",
                           port=self.port, log_level="error", non_blocking=True)

    def start(self) -> str:
        url = f"http://127.0.0.1:{self.port}"
        import httpx
        for _ in range(500):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("transformers serve did not start")

    def stop(self) -> None:
        self.serve.kill_server()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- clients --------------------------------------------------------------------------
def one_request(client, model: str, prompt: str, max_tokens: int, usage_option: bool) -> dict:
    """One streamed completion; tokens from the usage the server reports (ours: asked with
    stream_options, transformers: always in its last chunk)."""
    extra = {"stream_options": {"include_usage": True}} if usage_option else {}
    start = time.perf_counter()
    stamps, tokens = [], None
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, **extra):
        if chunk.choices and chunk.choices[0].text.strip():
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    # a token decoding to no text (a special id) sends no chunk: stamps may be fewer than tokens
    decode = (tokens - 1) / (stamps[-1] - stamps[0]) if tokens and len(stamps) > 1 and stamps[-1] > stamps[0] \
        else None
    return {"tokens": tokens, "latency_s": end - start, "ttft_s": stamps[0] - start if stamps else None,
            "decode_tok_s": decode}


def level(url: str, model: str, clients: int, requests: int, max_tokens: int, prompt_words: int,
          usage_option: bool) -> dict:
    import openai

    runs, errors = [], []

    def client_loop(c: int) -> None:
        try:
            with openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=600, max_retries=0) as client:
                for i in range(requests):
                    prompt = " ".join(f"w{(c * 31 + i * 7 + j) % 500 + 3}" for j in range(prompt_words))
                    runs.append(one_request(client, model, prompt, max_tokens, usage_option))
        except Exception as err:  # noqa: BLE001  reported in the results
            errors.append(f"client {c}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "errors": errors, "wall_s": wall, "runs": runs,
            "requests_per_s": len(runs) / wall, "tokens_per_s": sum(r["tokens"] or 0 for r in runs) / wall,
            "complete": len(runs) == clients * requests and all(r["tokens"] == max_tokens for r in runs)}


def start_all(makers: dict, names: list[str]) -> tuple[dict, dict]:
    """Every server up at once (only one works at a time), so rounds can alternate between them."""
    running, skipped = {}, {}
    for name in names:
        try:
            server = makers[name]()
        except Exception as err:  # noqa: BLE001  transformers serve may lack its dependencies
            skipped[name] = f"{type(err).__name__}: {err}"
            continue
        running[name] = (server, server.start())
    return running, skipped


def summarize(name: str, rounds: list[dict]) -> dict:
    """Medians over rounds of one server at one level (the machine is shared and noisy)."""
    runs = [r for row in rounds for r in row["runs"]]
    rates = [r["decode_tok_s"] for r in runs if r["decode_tok_s"]]
    return {"clients": rounds[0]["clients"], "rounds": len(rounds), "requests": len(runs),
            "requests_per_s_median": statistics.median(r["requests_per_s"] for r in rounds),
            "requests_per_s_rounds": [r["requests_per_s"] for r in rounds],
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rounds),
            "decode_tok_s_median": statistics.median(rates) if rates else None,
            "latency_s_median": statistics.median(r["latency_s"] for r in runs),
            "ttft_s_median": statistics.median(r["ttft_s"] for r in runs if r["ttft_s"]),
            "complete": all(r["complete"] for r in rounds),
            "errors": [e for r in rounds for e in r["errors"]]}


def _model_id(name: str, path: Path) -> str:
    return str(path) if name == "transformers" else path.name  # transformers serve names it by path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    ap.add_argument("--prompt", type=int, default=16, help="prompt words (= tokens)")
    ap.add_argument("--requests", type=int, default=4, help="requests per client at each level")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every level on every server")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--servers", default="expertcache,uncached,transformers")
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": tf.__version__,
                       "torch_threads": args.threads, "load_average_before": os.getloadavg()},
           "settings": {"model": "qwen3_moe hidden 256, 4 MoE layers, 32 experts, top-4, moe FF 256, fp32",
                        "cache": "64 of 128 experts in slots, default policy, miss fetch, device cpu",
                        "max_tokens": args.max_tokens, "prompt_tokens": args.prompt,
                        "requests_per_client": args.requests, "levels": LEVELS, "rounds": args.rounds,
                        "greedy": True, "stream": True},
           "servers": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-qwen3-moe"
        save_model(path)
        makers = {"expertcache": lambda: OurServer(path, True), "uncached": lambda: OurServer(path, False),
                  "transformers": lambda: TransformersServer(path)}
        running, skipped = start_all(makers, args.servers.split(","))
        rounds = {(name, n): [] for name in running for n in LEVELS}
        try:
            for name, (_, url) in running.items():  # warm up: allocator, first-call dispatch
                level(url, _model_id(name, path), 1, 1, 4, args.prompt, name != "transformers")
            for r in range(args.rounds):
                for n in LEVELS:
                    for name, (_, url) in running.items():
                        rounds[name, n].append(level(url, _model_id(name, path), n, args.requests,
                                                     args.max_tokens, args.prompt, name != "transformers"))
        finally:
            for server, _ in running.values():
                server.stop()
        for name in running:
            rows = [summarize(name, rounds[name, n]) for n in LEVELS]
            entry = {"server": name, "levels": rows}
            if name == "expertcache":
                stats = running[name][0].model.expertcache.stats()
                entry.update(hit_rate_decode=stats.total("decode").hit_rate,
                             h2d_bytes_decode=stats.h2d_bytes("decode"))
            out["servers"].append(entry)
            for row in rows:
                print(f"{name:<13} clients {row['clients']}: {row['requests_per_s_median']:.2f} req/s, "
                      f"decode {row['decode_tok_s_median'] or 0:.1f} tok/s per request, latency "
                      f"{row['latency_s_median']:.2f} s, complete {row['complete']}, errors {len(row['errors'])}")
        out["servers"] += [{"server": name, "skipped": why} for name, why in skipped.items()]
    out["machine"]["load_average_after"] = os.getloadavg()  # a shared machine: other jobs ran too
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
