"""``expertcache probe [-o profile.json]``: measure this machine for the cost model."""

from __future__ import annotations

import json
from dataclasses import asdict

from .paths import check_output

DESCRIPTION = ("Measure this machine for the cost model: CPU matmul rate and host memory "
               "bandwidth (numpy), ggml's quantized matmul rate where expertcache[ggml] is installed, "
               "and with CUDA the pinned host-to-device and device memory bandwidth (torch). "
               "What cannot be measured here comes from the --base preset. "
               "Prints the profile as JSON; 'sim --hardware FILE' and 'bench --hardware FILE' read it.")


def add_parser(sub) -> None:
    p = sub.add_parser("probe", help="measure CPU matmul rate, memory and PCIe bandwidth "
                                     "into a profile for 'sim --hardware FILE'",
                       description=DESCRIPTION)
    p.add_argument("-o", "--output", metavar="FILE", help="write the profile JSON here")
    p.add_argument("--base", default="pcie4-consumer",
                   help="preset supplying what cannot be measured (GPU figures without CUDA)")
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    p.add_argument("--disk", metavar="FILE", help="also measure O_DIRECT read bandwidth on this file (a model "
                   "file on the drive host_memory='tiered' reads from; up to 1 GiB of it is read)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..costmodel.hardware import probe, save_profile

    if args.seconds <= 0:
        raise ValueError(f"--seconds must be positive, got {args.seconds}")
    check_output(args.output, "-o")
    hw, report = probe(args.base, args.seconds)
    if args.disk:  # the drive's rate around the page cache: what the RAM tier's misses cost
        from dataclasses import replace

        from ..runtime.directio import read_bandwidth
        hw = replace(hw, disk_gbps=read_bandwidth(args.disk, limit=1 << 30) / 1e9)
        report["measured"] = sorted([*report["measured"], "disk_gbps"])
    print(json.dumps({**asdict(hw), **report}, indent=2))
    if args.output:
        save_profile(hw, args.output, report)
        print(f"wrote {args.output}")
    return 0
