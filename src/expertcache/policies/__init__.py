"""Eviction and admission policies (torch-free) and their registry."""

from .base import AdmissionPolicy, EvictionPolicy
from .registry import (admission_policies, eviction_policies, make_admission, make_eviction,
                       parse_spec, register)

__all__ = ["AdmissionPolicy", "EvictionPolicy", "admission_policies", "eviction_policies",
           "make_admission", "make_eviction", "parse_spec", "register"]
