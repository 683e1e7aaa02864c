"""Routing traces: the .npz format, importers, synthetic generators (numpy only, no torch).

Recording a live model's routing needs torch: ``integrations/record.py``.
"""

from .format import Trace, TraceError, load_trace, save_trace
from .importers import import_trace
from .synth import default_trace, synth_trace

__all__ = ["Trace", "TraceError", "default_trace", "import_trace", "load_trace", "save_trace",
           "synth_trace"]
