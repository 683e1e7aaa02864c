"""One validated description of a cache run: capacity, policies, miss path, baseline, device.

``CacheConfig`` is what ``offload()``, the ``generate`` CLI and the benchmarks share.
Every field is checked in ``__post_init__`` so a bad value fails early with a message
that says what to write instead; code further in takes the validated object and does
not check again. The choice tuples below are the only copies: the CLI's ``choices``
and the simulator's cost model read them from here. Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .cache import PARTITIONS
from .policies.registry import admission_class, check_params, eviction_class, needs_future
from .sizes import parse_size

MISS_PATHS = ("fetch", "cpu", "auto")
BASELINES = ("resident", "copy-every-pass", "cpu")
DTYPES = ("float32", "float16", "bfloat16")
IMATRIX_MODES = ("pin", "seed")
# How a slot holds a quantized expert (docs/quantized.md): its quantized bytes, dequantized per
# step into scratch, or the compute dtype, dequantized once on load. 'auto' picks per device.
SLOT_FORMATS = ("auto", "quantized", "dequantized")
# Where quantized expert bytes live on the host: a copy in RAM (pinned with CUDA), the
# memory-mapped file (the OS page cache is the middle tier), or 'auto': a copy when it fits.
HOST_MEMORY = ("auto", "copy", "mmap")


@dataclass(frozen=True)
class CacheConfig:
    """How the expert cache runs.

    Capacity: ``slots`` (experts the device pool caches, all layers together) or
    ``gpu_memory`` (a budget such as ``"8GiB"`` the pool, staging and scratch included,
    must fit in). One of them is required unless nothing is cached (baselines
    'resident': every expert; 'cpu' and 'copy-every-pass': none; admission 'never').
    ``staging`` extra slots stream the experts a step needs beyond what the cache admits
    (default: top-k); they are not part of ``slots``. ``slot_format`` and
    ``host_memory`` only matter for quantized experts (GGUF files, MXFP4, FP8).
    """

    slots: int | None = None
    gpu_memory: str | int | None = None
    partition: str = "global"
    eviction: str = "default"
    admission: str = "always"
    eviction_params: dict = field(default_factory=dict)
    admission_params: dict = field(default_factory=dict)
    miss: str = "fetch"
    baseline: str | None = None
    staging: int | None = None
    device: str | None = None
    dtype: str | None = None
    imatrix: str | None = None          # per-expert counts (imatrix .gguf, trace, .npy, JSON): hot experts
    imatrix_mode: str = "pin"           # placed before step 1: 'pin' (never evicted) or 'seed' (evictable)
    slot_format: str = "auto"
    host_memory: str = "auto"
    hardware: str | None = None         # cost-model rates for miss='auto': a preset or a probe profile

    def __post_init__(self) -> None:
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
        if self.device is not None and not isinstance(self.device, str):
            # accept torch.device without importing torch (frozen: set through object)
            object.__setattr__(self, "device", str(self.device))
        if self.imatrix is not None and not isinstance(self.imatrix, str):
            object.__setattr__(self, "imatrix", str(self.imatrix))
        object.__setattr__(self, "eviction_params",
                           check_params(eviction_class(self.eviction), dict(self.eviction_params)))
        object.__setattr__(self, "admission_params",
                           check_params(admission_class(self.admission), dict(self.admission_params)))
        if needs_future(self.eviction, self.eviction_params):  # static(inner=belady) too
            raise ValueError(f"eviction policy {self.eviction!r} is an offline oracle that needs future "
                             "accesses; a live run cannot know them. Use it in `expertcache sim`")
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

    @staticmethod
    def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}; use one of {', '.join(choices)}")

    @property
    def needs_size(self) -> bool:
        """Whether the pool caches experts, so that slots or gpu_memory must say how many."""
        return self.baseline is None and self.admission != "never"

    @property
    def gpu_memory_bytes(self) -> int | None:
        return None if self.gpu_memory is None else parse_size(self.gpu_memory)

    def effective(self) -> CacheConfig:
        """The configuration a baseline stands for (DESIGN.md: baselines are configurations)."""
        if self.baseline == "copy-every-pass":  # llama.cpp: copy used experts each pass, keep none
            return replace(self, admission="never", admission_params={}, miss="fetch")
        if self.baseline == "cpu":  # llama.cpp --cpu-moe: experts computed on the host
            return replace(self, admission="never", admission_params={}, miss="cpu")
        return self  # 'resident' is sized by the runtime: one slot per expert, all preloaded

    def to_dict(self) -> dict:
        return asdict(self)
