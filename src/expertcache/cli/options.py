"""Options that ``generate`` and ``serve`` share: the cache settings and the sampling flags."""

from __future__ import annotations

POLICY_HELP = ("EVICTION[:KEY=VALUE...][+ADMISSION[:KEY=VALUE...]], e.g. default, lru, "
               "slru:protected=0.5+second-hit, lru+window:n=3:w=32 (parameters: expertcache policies)")


def add_cache_options(p) -> None:
    from ..config import (BASELINES, CPU_GRAPHS, CPU_KERNELS, CPU_REPACKS, DTYPES, HOST_MEMORY, IMATRIX_MODES, MISS_PATHS,
                          PARTITIONS, PLANNERS, SLOT_FORMATS, GRAPH_MODES)

    size = p.add_mutually_exclusive_group()
    size.add_argument("--slots", type=int, help="experts the device pool caches (all layers)")
    size.add_argument("--gpu-memory", metavar="SIZE", help="device memory for the pool, e.g. 8GiB")
    p.add_argument("--policy", default="default", metavar="POLICY", help=POLICY_HELP)
    p.add_argument("--partition", default="global", choices=PARTITIONS)
    p.add_argument("--miss", default="fetch", choices=MISS_PATHS)
    p.add_argument("--baseline", choices=BASELINES)
    p.add_argument("--staging", type=int, help="extra slots that stream bypassed experts (default top-k)")
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES)
    p.add_argument("--slot-format", default="auto", choices=SLOT_FORMATS,
                   help="quantized experts: slots hold the quantized bytes (dequantized per use) or the "
                        "compute dtype (dequantized once per load); auto: quantized on a GPU and on the "
                        "CPU with ggml kernels, else dequantized (docs/quantized.md)")
    p.add_argument("--cpu-kernel", default="auto", choices=CPU_KERNELS,
                   help="quantized experts computed on the CPU: ggml's kernels on the stored bytes "
                        "(llama.cpp's; activations quantized to 8 bits), torch (dequantize, then matmul: "
                        "exact), or auto: ggml when libggml-python is installed and the type has a "
                        "kernel (docs/cpu.md)")
    p.add_argument("--cpu-graph", default="auto", choices=CPU_GRAPHS,
                   help="a GGUF decode step on the CPU with ggml as one ggml graph a token (Qwen3-MoE, "
                        "Qwen2-MoE; resident or baseline cpu), or off: per-layer ggml and torch ops "
                        "(docs/cpu.md)")
    p.add_argument("--cpu-repack", default="auto", choices=CPU_REPACKS,
                   help="with --cpu-graph: quantized weights repacked at load for ggml's faster CPU kernels "
                        "(llama.cpp's default) while they take under half the free RAM, the file's pages "
                        "released; off: read in place from the file (docs/cpu.md)")
    p.add_argument("--host-memory", default="auto", choices=HOST_MEMORY,
                   help="quantized experts on the host: a copy in RAM (pinned with CUDA), the "
                        "memory-mapped file, auto (a pinned copy when it fits, else the file), or tiered "
                        "(a RAM tier of --host-budget experts over the file, read with O_DIRECT; docs/tiers.md)")
    p.add_argument("--host-budget", metavar="SIZE",
                   help="--host-memory tiered: RAM for experts, bytes (2GiB), a share of them (25%%), or auto "
                        "(the RAM free at load less the dense weights and a 15%% margin, at least 2GiB)")
    p.add_argument("--host-policy", default="default", metavar="EVICTION",
                   help="--host-memory tiered: the RAM tier's eviction policy (default: default)")
    p.add_argument("--hardware", help="cost-model profile for --miss auto: a preset (pcie4-consumer, "
                   "pcie5-consumer, h200) or a JSON file from 'expertcache probe'")
    p.add_argument("--imatrix", metavar="FILE", help="imatrix .gguf (or trace / counts file) whose hot "
                   "experts are placed before the first token (docs/imatrix.md)")
    p.add_argument("--imatrix-mode", default="pin", choices=IMATRIX_MODES,
                   help="pin: never evicted, at most half the cache; seed: preloaded, evictable")
    p.add_argument("--planner", default="auto", choices=PLANNERS,
                   help="who plans decode steps: host (routing read back per MoE layer), device "
                        "(lookup and staging on the device, the policy --lag forwards behind; "
                        "docs/runtime.md) or auto (device where decode is captured in graphs: CUDA)")
    p.add_argument("--lag", type=int, help="--planner device: forwards the policy runs behind (default 1)")
    p.add_argument("--staging-blocks", type=int, default=None,
                   help="--planner device: staging rows in this many blocks, layer l staging into block "
                        "l %% B (default: one block per layer of --staging rows each, so admitted misses "
                        "are loaded from their staging row; give --staging B*batch*top-k with this flag)")
    p.add_argument("--graphs", default="auto", choices=GRAPH_MODES,
                   help="decode replayed from a captured graph, one replay a token (needs --planner "
                        "device): on, off, or auto (on with CUDA). On the CPU 'on' compiles the step "
                        "whole (torch.compile fullgraph); docs/runtime.md")


def cache_config(args):
    """The CacheConfig the cache options describe (policy parameters validated here)."""
    from ..config import CacheConfig
    from ..policies.registry import parse_policy

    _device_only(args)
    policy = parse_policy(args.policy)
    return CacheConfig(slots=args.slots, gpu_memory=args.gpu_memory, eviction=policy.eviction,
                       admission=policy.admission, partition=args.partition,
                       miss=args.miss, baseline=args.baseline, staging=args.staging,
                       device=args.device, dtype=args.dtype, imatrix=args.imatrix,
                       imatrix_mode=args.imatrix_mode, slot_format=args.slot_format,
                       host_memory=args.host_memory, cpu_kernel=args.cpu_kernel,
                       cpu_graph=args.cpu_graph, cpu_repack=args.cpu_repack, hardware=args.hardware,
                       host_budget=_budget(args.host_budget), host_policy=args.host_policy,
                       planner=args.planner, lag=1 if args.lag is None else args.lag,
                       staging_blocks=args.staging_blocks, graphs=args.graphs)


def _device_only(args) -> None:
    """Refuse --lag / --staging-blocks given with the host planner, which has no lag (the
    settings are the device planner's; silently ignoring them misleads)."""
    given = [flag for flag, value in (("--lag", args.lag), ("--staging-blocks", args.staging_blocks))
             if value is not None]
    if given and args.planner != "device":
        raise ValueError(f"{' and '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --planner "
                         f"device only (the host planner "
                         f"plans each step as it runs, with no lag): add --planner device or drop "
                         f"{'them' if len(given) > 1 else 'it'}")


def _budget(text: str | None):
    """--host-budget as the library takes it: '25%' and sizes as given, a bare 0.25 as a share."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return text
    return value if 0 < value <= 1 else text


def add_sampling_options(p, temperature: float) -> None:
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 is greedy (default {temperature:g})")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: off)")
    p.add_argument("--seed", type=int, help="seed for sampling (same seed, same text)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable)")


def sampling(args):
    from ..runtime.sampling import Sampling

    return Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                    stop=tuple(args.stop))
