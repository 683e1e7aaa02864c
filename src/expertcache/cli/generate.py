"""``expertcache generate``: run a local MoE checkpoint through the expert cache."""

from __future__ import annotations

import json
from pathlib import Path


def add_parser(sub) -> None:
    from ..cache import PARTITIONS
    from ..config import BASELINES, DTYPES, HOST_MEMORY, IMATRIX_MODES, MISS_PATHS, SLOT_FORMATS

    p = sub.add_parser("generate", help="generate text with the expert cache and report speed and hits",
                       description="Greedy generation from a local checkpoint directory with experts in "
                                   "host memory behind a device slot pool; prints the text, then prefill "
                                   "and decode tok/s (cold: first 16 tokens; steady: the rest), hit rate, "
                                   "H2D bytes per token and the slot pool size.")
    p.add_argument("model", metavar="MODEL", help="a GGUF file (model.gguf, or the first part of a split "
                   "one; experts stay quantized) or a local checkpoint directory (save_pretrained layout)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--slots", type=int, help="experts the device pool caches (all layers)")
    size.add_argument("--gpu-memory", metavar="SIZE", help="device memory for the pool, e.g. 8GiB")
    p.add_argument("--policy", default="default", metavar="EVICTION[+ADMISSION]",
                   help="e.g. default, lru, slru+second-hit (default: the registry's "
                        "'default' policy; see expertcache policies)")
    p.add_argument("--partition", default="global", choices=PARTITIONS)
    p.add_argument("--miss", default="fetch", choices=MISS_PATHS)
    p.add_argument("--baseline", choices=BASELINES)
    p.add_argument("--staging", type=int, help="extra slots that stream bypassed experts (default top-k)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES)
    p.add_argument("--slot-format", default="auto", choices=SLOT_FORMATS,
                   help="quantized experts: slots hold the quantized bytes (dequantized per use) or the "
                        "compute dtype (dequantized once per load); auto: quantized on a GPU, "
                        "dequantized on the CPU (docs/quantized.md)")
    p.add_argument("--host-memory", default="auto", choices=HOST_MEMORY,
                   help="quantized experts on the host: a copy in RAM (pinned with CUDA), the "
                        "memory-mapped file, or auto (a pinned copy when it fits, else the file)")
    p.add_argument("--hardware", help="cost-model profile for --miss auto: a preset (pcie4-consumer, "
                   "pcie5-consumer, h200) or a JSON file from 'expertcache probe'")
    p.add_argument("--json", metavar="OUT", help="also save the summary as JSON")
    p.add_argument("--imatrix", metavar="FILE", help="imatrix .gguf (or trace / counts file) whose hot "
                   "experts are placed before the first token (docs/imatrix.md)")
    p.add_argument("--imatrix-mode", default="pin", choices=IMATRIX_MODES,
                   help="pin: never evicted, at most half the cache; seed: preloaded, evictable")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..config import CacheConfig
    from ..integrations.transformers import check_model_path, load_tokenizer, offload
    from ..policies.registry import parse_spec
    from ..runtime.generate import format_summary, generate_and_measure

    prompt = args.prompt if args.prompt is not None else _read(args.prompt_file)
    eviction, admission = parse_spec(args.policy)
    config = CacheConfig(slots=args.slots, gpu_memory=args.gpu_memory, eviction=eviction,
                         admission=admission, partition=args.partition, miss=args.miss,
                         baseline=args.baseline, staging=args.staging, device=args.device, dtype=args.dtype,
                         imatrix=args.imatrix, imatrix_mode=args.imatrix_mode, slot_format=args.slot_format,
                         host_memory=args.host_memory, hardware=args.hardware)
    check_model_path(Path(args.model))
    tokenizer = load_tokenizer(args.model)
    model = offload(args.model, config=config).eval()
    text, summary = generate_and_measure(model, tokenizer, prompt, args.max_new_tokens)
    print(text)
    print()
    print(format_summary(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def _read(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"prompt file not found: {file}")
    return file.read_text()
