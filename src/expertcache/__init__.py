"""expertcache: a persistent GPU expert cache for Mixture-of-Experts models."""

from .cache import Plan, SlotTable
from .keys import ExpertKey
from .policies import AdmissionPolicy, EvictionPolicy, register
from .stats import Counts, Stats

__version__ = "0.1.0"

__all__ = ["AdmissionPolicy", "Counts", "EvictionPolicy", "ExpertKey", "Plan", "SlotTable",
           "Stats", "offload", "register", "__version__"]


# Subpackages and modules reached as attributes (``expertcache.integrations.transformers``,
# ``expertcache.sim``) import on first use, so that `import expertcache` stays torch-free.
_SUBMODULES = ("bench", "cli", "config", "decode_phases", "ggufmodel", "imatrix", "integrations", "presets",
               "quant", "runtime", "serve", "sim", "sizes", "trace")


def __getattr__(name: str):
    # offload needs torch + transformers: import it on first use so `import expertcache` stays torch-free
    if name == "offload":
        from .integrations.transformers import offload
        return offload
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'expertcache' has no attribute {name!r}")
