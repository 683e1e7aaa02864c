"""Routing traces: the .npz format, importers, synthetic generators, recording."""

from .format import Trace, TraceError, load_trace, save_trace

__all__ = ["Trace", "TraceError", "load_trace", "save_trace"]
