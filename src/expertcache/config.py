"""One validated description of a cache run: capacity, policies, miss path, baseline, device.

``CacheConfig`` is what ``offload()``, the ``generate`` CLI and the benchmarks share.
Every field is checked in ``__post_init__`` so a bad value fails early with a message
that says what to write instead; code further in takes the validated object and does
not check again. The choice tuples below are the only copies: the CLI's ``choices``
and the simulator's cost model read them from here. Torch-free.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, fields, replace

from .cache import PARTITIONS  # noqa: F401  (defined by the table that implements them; the CLI reads it here)
from .policies.registry import PolicySpec, admission_spec, eviction_spec, own_admission
from .sizes import parse_size

MISS_PATHS = ("fetch", "cpu", "auto")
BASELINES = ("resident", "copy-every-pass", "cpu")
DTYPES = ("float32", "float16", "bfloat16")
IMATRIX_MODES = ("pin", "seed")
# How a slot holds a quantized expert (docs/quantized.md): its quantized bytes, dequantized per
# step into scratch, or the compute dtype, dequantized once on load. 'auto' picks per device.
QUANT_SLOT_FORMATS = ("quantized", "dequantized")
SLOT_FORMATS = ("auto", *QUANT_SLOT_FORMATS)
# What a pool slot holds once 'auto' is resolved: 'plain' for experts that were never quantized.
SLOT_KINDS = ("plain", *QUANT_SLOT_FORMATS)
# Where quantized expert bytes live on the host: a copy in RAM (pinned with CUDA), the
# memory-mapped file (the OS page cache is the middle tier), 'auto': a copy when it fits, or
# 'tiered': a RAM tier of ``host_budget`` experts under its own policy over the file, read with
# O_DIRECT (runtime/tiered.py, docs/tiers.md).
HOST_MEMORY = ("auto", "copy", "mmap", "tiered")
# How experts computed on the CPU (miss path 'cpu', baseline 'cpu', slots on a CPU device) do
# their math: 'ggml' runs ggml's quantized kernels on the stored bytes (what llama.cpp runs;
# activations quantized to 8 bits, docs/cpu.md), 'torch' dequantizes then matmuls (exact),
# 'auto' takes ggml where libggml-python is installed and the expert type has a kernel.
CPU_KERNELS = ("auto", "ggml", "torch")
CPU_REPACKS = ("auto", "off")  # the graph's weights repacked for ggml's faster CPU kernels (llama.cpp's default)
CPU_GRAPHS = ("auto", "off")  # decode as one ggml graph a token on the CPU (runtime/ggmlgraph.py)
# Who plans a decode step (docs/runtime.md): 'host' reads the routing back and plans each MoE
# layer's step at once; 'device' looks the experts up on the device, stages its misses itself
# and runs the policy on the host ``lag`` forwards behind (runtime/devicestep.py, lagged.py).
# 'auto' takes 'device' where decode will be captured (CUDA unless graphs='off'; graphs='on'
# anywhere) and the device step can run, else 'host'; summary()['planner_reason'] says which.
PLANNERS = ("auto", "host", "device")
# Decode in captured graphs (runtime/graphs.py): 'on' captures (CUDA graphs; on the CPU the step
# is compiled whole), 'off' decodes eagerly, 'auto' captures on CUDA only. Capture needs
# planner='device'; where it cannot run, decode is eager and summary()['graphs'] says why.
GRAPH_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class CacheConfig:
    """How the expert cache runs.

    Capacity: ``slots`` (experts the device pool caches, all layers together) or
    ``gpu_memory`` (a budget such as ``"8GiB"`` the pool, staging and scratch included,
    must fit in). One of them is required unless nothing is cached (baselines
    'resident': every expert; 'cpu' and 'copy-every-pass': none; admission 'never').
    ``staging`` extra slots stream the experts a step needs beyond what the cache admits
    (default: top-k); they are not part of ``slots``. ``slot_format`` and
    ``host_memory`` only matter for quantized experts (GGUF files, MXFP4, FP8), and so does
    ``cpu_kernel``: how such experts are computed wherever they are computed on the CPU.
    """

    slots: int | None = None
    gpu_memory: str | int | None = None
    partition: str = "global"
    eviction: PolicySpec = "default"    # given as a spec, a name or 'slru:protected=0.5'; held as a spec
    admission: PolicySpec | None = None  # None: the eviction policy's own (registry.own_admission)
    miss: str = "fetch"
    baseline: str | None = None
    staging: int | None = None
    device: str | None = None
    dtype: str | None = None
    imatrix: str | None = None          # per-expert counts (imatrix .gguf, trace, .npy, JSON): hot experts
    imatrix_mode: str = "pin"           # placed before step 1: 'pin' (never evicted) or 'seed' (evictable)
    slot_format: str = "auto"
    host_memory: str = "auto"
    cpu_kernel: str = "auto"            # quantized experts on the CPU: CPU_KERNELS
    cpu_graph: str = "auto"             # CPU_GRAPHS: a GGUF decode step as one ggml graph where supported
    cpu_repack: str = "auto"            # CPU_REPACKS: with the graph, quantized weights repacked at load while
    #                                     they take under half the free RAM (else read in place)
    hardware: str | None = None         # cost-model rates for miss='auto': a preset or a probe profile
    #                                     (None: measured on this machine at load)
    planner: str = "auto"               # PLANNERS: who plans decode steps
    lag: int = 1                        # planner='device': forwards the policy's decisions run behind
    staging_blocks: int | None = None   # planner='device': staging rows in blocks, layer l -> block l % n
    #                                     (None: one block per layer, staging default layers x top-k)
    graphs: str = "auto"                # GRAPH_MODES: decode replayed from a captured graph
    host_budget: str | int | float | None = None  # host_memory='tiered': RAM for experts, '2GiB', '25%'/0.25, 'auto'
    host_policy: PolicySpec = "default"  # host_memory="tiered": the RAM tier's eviction (docs/tiers.md)
    # Parameters by name, merged into the policy specs at construction (they win over a spec's own).
    eviction_params: InitVar[dict | None] = None
    admission_params: InitVar[dict | None] = None

    def __post_init__(self, eviction_params: dict | None, admission_params: dict | None) -> None:
        # Policies first: names, parameter types and ranges are checked here, before any load.
        object.__setattr__(self, "eviction", eviction_spec(self.eviction, eviction_params))
        admission = own_admission(self.eviction.cls) if self.admission is None else self.admission
        object.__setattr__(self, "admission", admission_spec(admission, admission_params))
        self._check_capacity()
        self._check_choice("partition", self.partition, PARTITIONS)
        self._check_choice("miss", self.miss, MISS_PATHS)
        if self.baseline is not None:
            self._check_choice("baseline", self.baseline, BASELINES)
        if self.dtype is not None:
            self._check_choice("dtype", self.dtype, DTYPES)
        self._check_choice("imatrix_mode", self.imatrix_mode, IMATRIX_MODES)
        self._check_choice("slot_format", self.slot_format, SLOT_FORMATS)
        self._check_choice("host_memory", self.host_memory, HOST_MEMORY)
        self._check_choice("cpu_kernel", self.cpu_kernel, CPU_KERNELS)
        self._check_tier()
        self._check_choice("cpu_graph", self.cpu_graph, CPU_GRAPHS)
        self._check_choice("cpu_repack", self.cpu_repack, CPU_REPACKS)
        self._check_choice("planner", self.planner, PLANNERS)
        if self.planner != "device" and (self.lag != 1 or self.staging_blocks not in (None, 1)):
            raise ValueError(f"lag and staging_blocks apply to planner='device' only (planner={self.planner!r} "
                             "may plan each step on the host as it runs, with no lag): set planner='device' "
                             "or leave them out")
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 1:
            raise ValueError(f"lag must be a whole number of forwards >= 1 (planner='device'), got {self.lag!r}")
        self._check_choice("graphs", self.graphs, GRAPH_MODES)
        if self.staging_blocks is not None and (isinstance(self.staging_blocks, bool)
                                                or not isinstance(self.staging_blocks, int) or self.staging_blocks < 1):
            raise ValueError(f"staging_blocks must be a positive whole number, got {self.staging_blocks!r}")
        if self.staging is not None and self.staging_blocks is not None and self.staging_blocks > self.staging:
            raise ValueError(f"staging_blocks={self.staging_blocks} exceeds staging={self.staging}: each block "
                             "needs a row (give staging = blocks x batch x top-k)")
        if self.device is not None and not isinstance(self.device, str):
            # accept torch.device without importing torch (frozen: set through object)
            object.__setattr__(self, "device", str(self.device))
        if self.imatrix is not None and not isinstance(self.imatrix, str):
            object.__setattr__(self, "imatrix", str(self.imatrix))
        if self.eviction.needs_future:  # static(inner=belady) too
            raise ValueError(f"eviction policy {str(self.eviction)!r} is an offline oracle that needs "
                             "future accesses; a live run cannot know them. Use it in `expertcache sim`")
        if self.needs_size and self.slots is None and self.gpu_memory is None:
            raise ValueError("the cache needs a size: give slots=N or gpu_memory='8GiB' "
                             "(or baseline='resident' / 'cpu' / 'copy-every-pass')")

    def _check_capacity(self) -> None:
        if self.slots is not None and self.gpu_memory is not None:
            raise ValueError("give either slots or gpu_memory, not both")
        if self.slots is not None and (isinstance(self.slots, bool) or not isinstance(self.slots, int)
                                       or self.slots < 1):
            raise ValueError(f"slots must be a positive whole number, got {self.slots!r}")
        if self.gpu_memory is not None:
            parse_size(self.gpu_memory)
        if self.staging is not None and (isinstance(self.staging, bool) or not isinstance(self.staging, int)
                                         or self.staging < 1):
            raise ValueError(f"staging must be a positive whole number of slots, got {self.staging!r}")

    def _check_tier(self) -> None:
        object.__setattr__(self, "host_policy", eviction_spec(self.host_policy))
        if self.host_policy.needs_future:
            raise ValueError(f"host_policy {str(self.host_policy)!r} is an offline oracle; a live run cannot "
                             "know future accesses (use it in `expertcache sim`)")
        if self.host_memory != "tiered":
            if self.host_budget is not None:
                raise ValueError("host_budget sizes the RAM tier of host_memory='tiered'; give "
                                 "host_memory='tiered' with it, or leave host_budget out")
            return
        if self.host_budget is None:
            raise ValueError("host_memory='tiered' needs host_budget: the RAM the tier keeps experts in, "
                             "as bytes ('2GiB') or a share of all experts ('25%' or 0.25)")
        if self.host_budget != "auto":  # 'auto': sized from the free RAM at load (runtime/tiered.py)
            host_budget_share(self.host_budget)  # checks the spelling; sizes are checked at load

    @staticmethod
    def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}; use one of {', '.join(choices)}")

    @property
    def needs_size(self) -> bool:
        """Whether the pool caches experts, so that slots or gpu_memory must say how many."""
        return self.baseline is None and self.admission.name != "never"

    @property
    def gpu_memory_bytes(self) -> int | None:
        return None if self.gpu_memory is None else parse_size(self.gpu_memory)

    def effective(self) -> CacheConfig:
        """The configuration a baseline stands for (DESIGN.md: baselines are configurations)."""
        if self.baseline == "copy-every-pass":  # llama.cpp: copy used experts each pass, keep none
            return replace(self, admission="never", miss="fetch")
        if self.baseline == "cpu":  # llama.cpp --cpu-moe: experts computed on the host
            return replace(self, admission="never", miss="cpu")
        return self  # 'resident' is sized by the runtime: one slot per expert, all preloaded

    def to_dict(self) -> dict:
        """JSON-friendly: policies as their names plus ``*_params`` (the keywords that rebuild them)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for side in ("eviction", "admission"):
            out[side], out[f"{side}_params"] = out[side].name, dict(out[side].params)
        out["host_policy"] = str(self.host_policy)
        return out


def host_budget_share(budget: str | int | float) -> float | None:
    """``host_budget`` as a share of all experts ('25%', 0.25), or None when it is a size in bytes
    ('2GiB', 2147483648); ValueError for anything else ('auto' too: only a live run sizes it)."""
    if budget == "auto":
        raise ValueError("host_budget='auto' is sized from this machine's free RAM when a model loads; "
                         "here give a size ('16GiB') or a share of the experts ('25%')")
    if isinstance(budget, float) or (isinstance(budget, str) and budget.strip().endswith("%")):
        share = budget if isinstance(budget, float) else _percent(budget)
        if not 0 < share <= 1:
            raise ValueError(f"host_budget {budget!r} is a share of the experts; give one in (0, 1] or "
                             "(0%, 100%], e.g. 0.25 or '25%'")
        return share
    parse_size(budget)
    return None


def _percent(text: str) -> float:
    try:
        return float(text.strip()[:-1]) / 100
    except ValueError:
        raise ValueError(f"cannot read host_budget {text!r}; write e.g. '25%', 0.25 or '2GiB'") from None


def host_budget_rows(budget: str | int | float, total_experts: int, expert_bytes: int) -> int:
    """Experts the RAM tier holds for ``budget`` (a share of ``total_experts``, or bytes of
    ``expert_bytes`` each, rounded down), capped at every expert."""
    share = host_budget_share(budget)
    if share is not None:
        return min(total_experts, max(1, round(share * total_experts)))
    return min(total_experts, parse_size(budget) // expert_bytes)


def fraction_slots(fraction: float, total: int) -> int:
    """Slots holding ``fraction`` of ``total`` experts (rounded, at least 1): the one check of a
    share of the experts, for ``sim --fractions``, the bench and ``imatrix --fraction``."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be between 0 and 1: the share in (0, 1] of all {total} "
                         f"experts the slots hold, e.g. 0.125; got {fraction!r}")
    return max(1, round(fraction * total))
