"""Settings, and running the app under uvicorn: blocking (the CLI) or in a thread (tests, bench)."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading

from .app import Service, build_app
from .settings import ServeSettings, is_loopback, listen  # noqa: F401  (ServeSettings: re-exported)

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

    def _bind(self, sock: socket.socket | None = None) -> socket.socket:
        """The listening socket: ``sock`` when the caller bound it already (the CLI binds before
        loading the model, so a busy port or a foreign host costs no load), else a new one."""
        sock = sock or listen(self.settings.host, self.settings.port)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if sock.family == socket.AF_INET6 else host}:{port}"
        return sock

    def warn_if_exposed(self) -> None:
        if not is_loopback(self.settings.host):
            guard = "an API key is required" if self.settings.api_key else "no API key is set: add --api-key"
            print(f"expertcache serve: warning: listening on {self.settings.host}, beyond this machine's "
                  f"loopback; anyone who can reach it can use the model; {guard}", file=sys.stderr)

    def run(self, sock: socket.socket | None = None) -> None:
        """Serve until interrupted (Ctrl-C); ``sock``: a socket from ``listen`` (else one is bound)."""
        sock = self._bind(sock)
        self.warn_if_exposed()
        print(f"expertcache serve: {self.settings.model_name} at {self.url}/v1", file=sys.stderr)
        try:
            self.uvicorn.run(sockets=[sock])
            if self.uvicorn.should_exit:
                # a signal stopped it: uvicorn raises it again on the way out, but asyncio.run's
                # own SIGINT handler can swallow that (a race seen under load), so say it here
                raise KeyboardInterrupt
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
