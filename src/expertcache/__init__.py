"""expertcache: a persistent GPU expert cache for Mixture-of-Experts models."""

from .cache import Plan, SlotTable
from .keys import ExpertKey
from .policies import AdmissionPolicy, EvictionPolicy, register
from .stats import Counts, Stats

__version__ = "0.1.0"

__all__ = ["AdmissionPolicy", "Counts", "EvictionPolicy", "ExpertKey", "Plan", "SlotTable",
           "Stats", "offload", "register", "__version__"]


def __getattr__(name: str):
    # offload needs torch + transformers: import it on first use so `import expertcache` stays torch-free
    if name == "offload":
        from .integrations.transformers import offload
        return offload
    raise AttributeError(f"module 'expertcache' has no attribute {name!r}")
