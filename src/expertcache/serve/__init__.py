"""``expertcache serve``: an OpenAI-compatible HTTP server for one offloaded model.

``app`` (Starlette routes), ``schemas`` (request bodies and their limits), ``worker``
(the one thread that owns the model), ``responses`` (OpenAI response and chunk shapes),
``telemetry`` (cache and speed figures), ``server`` (uvicorn, settings, start/stop).
Needs the ``serve`` extra: starlette, uvicorn, pydantic.
"""

from __future__ import annotations

__all__ = ["ServeSettings", "Server"]


def __getattr__(name):
    if name in __all__:
        from . import server
        return getattr(server, name)
    raise AttributeError(name)
