"""Settings, and running the app under uvicorn: blocking (the CLI) or in a thread (tests, bench)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import sys
import threading
from dataclasses import dataclass

from .app import Service, build_app

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


class Server:
    """One model served over HTTP. ``start()`` runs it in a thread and returns the base URL."""

    def __init__(self, model, tokenizer, settings: ServeSettings) -> None:
        import uvicorn

        self.settings = settings
        self.service = Service(model, tokenizer, settings)
        config = uvicorn.Config(build_app(self.service), log_level=settings.log_level, lifespan="off",
                                timeout_graceful_shutdown=5)
        self.uvicorn = uvicorn.Server(config)
        self.thread: threading.Thread | None = None
        self.url: str | None = None

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.settings.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.settings.host, self.settings.port))  # port 0: a free one
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if family == socket.AF_INET6 else host}:{port}"
        return sock

    def warn_if_exposed(self) -> None:
        if not is_loopback(self.settings.host):
            guard = "an API key is required" if self.settings.api_key else "no API key is set: add --api-key"
            print(f"expertcache serve: warning: listening on {self.settings.host}, beyond this machine's "
                  f"loopback; anyone who can reach it can use the model; {guard}", file=sys.stderr)

    def run(self) -> None:
        """Serve until interrupted (Ctrl-C)."""
        sock = self._bind()
        self.warn_if_exposed()
        print(f"expertcache serve: {self.settings.model_name} at {self.url}/v1", file=sys.stderr)
        try:
            self.uvicorn.run(sockets=[sock])
        finally:
            self.service.worker.stop()

    def start(self, timeout: float = 30.0) -> str:
        """Serve from a background thread; returns the base URL once it accepts connections."""
        sock = self._bind()
        self.warn_if_exposed()
        self.thread = threading.Thread(target=lambda: asyncio.run(self.uvicorn.serve(sockets=[sock])),
                                       name="expertcache-http", daemon=True)
        self.thread.start()
        for _ in range(int(timeout / 0.02)):
            if self.uvicorn.started:
                return self.url
            if not self.thread.is_alive():
                break
            threading.Event().wait(0.02)
        raise RuntimeError(f"the server did not start within {timeout:g} s")

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel queued and running requests (their streams end), then close the listener."""
        self.service.worker.stop(timeout)
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
