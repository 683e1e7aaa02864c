"""expertcache: a persistent GPU expert cache for Mixture-of-Experts models."""

from .cache import Plan, SlotTable
from .keys import ExpertKey
from .policies import AdmissionPolicy, EvictionPolicy, register
from .stats import Counts, Stats

__version__ = "0.1.0"

__all__ = ["AdmissionPolicy", "Counts", "EvictionPolicy", "ExpertKey", "Plan", "SlotTable",
           "Stats", "register", "__version__"]
