"""Serving settings and the listening socket: checked and bound before any model loads.

Torch-free (the CLI imports it before the runtime), so a bad ``--port``, a port in use or a
host that is not this machine's is refused in a moment, not after the model has loaded.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass

LOOPBACK_NAMES = ("localhost",)


@dataclass
class ServeSettings:
    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 1 << 20       # 1 MiB of JSON is far more than any prompt the limits allow
    max_prompt_tokens: int | None = None  # None: the model's context decides
    max_tokens: int = 2048              # per request
    max_queue: int = 64                 # requests waiting; more get 503
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be a whole number in 0-65535 (0: any free port), got {self.port!r}")
        for name in ("max_body_bytes", "max_tokens", "max_queue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive whole number, got {value!r}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be positive, got {self.max_prompt_tokens!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty; give a non-empty key or none")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: may resolve anywhere




def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one); one-line ValueErrors for a port in
    use, a host name that does not resolve, or an address this machine does not have."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"cannot listen on host {host!r}: the name does not resolve "
                         f"({getattr(err, 'strerror', None) or err}); give an address of this machine, "
                         "e.g. 127.0.0.1 or 0.0.0.0") from None
    # IPv4 first where a name has both (what a plain socket bound before): the printed URL
    family, _, _, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise ValueError(_bind_error(host, port, err)) from None
    return sock


def _bind_error(host: str, port: int, err: OSError) -> str:
    where = f"{host}:{port}"
    if err.errno == errno.EADDRINUSE:
        return f"cannot listen on {where}: the port is already in use (another server?); choose another port"
    if err.errno == errno.EADDRNOTAVAIL:
        return (f"cannot listen on {where}: {host} is not an address of this machine; give one of its "
                "addresses, e.g. 127.0.0.1 or 0.0.0.0 (all)")
    if err.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied (ports below 1024 need privileges)"
    return f"cannot listen on {where}: {err.strerror or err}"
