"""``expertcache serve`` as a user starts it: a subprocess on a free port, the key from the environment."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from tiny_chat import chat_tokenizer  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"


def listening_url(proc, seconds: float) -> str:
    """Read stderr (in a thread, so a silent hang cannot block the test) until the URL line."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stderr.readline, "")], daemon=True).start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, "the server exited before listening"
            continue
        if m := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line):
            return m.group(1)
    raise AssertionError(f"the server did not say where it listens within {seconds:g} s")


def test_cli_serves_with_key_from_environment(tmp_path):
    ckpt = tmp_path / "tiny-chat"
    tiny_model("mixtral").save_pretrained(ckpt)
    chat_tokenizer().save_pretrained(ckpt)
    env = {**os.environ, "EXPERTCACHE_API_KEY": "k3y", "PYTHONPATH": f"{SRC}{os.pathsep}"
           + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", "import sys; from expertcache.cli import main; sys.exit(main(sys.argv[1:]))",
           "serve", str(ckpt), "--port", "0", "--slots", "5",
           "--policy", "lru+second-hit:ghost=32", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = listening_url(proc, seconds=120)
        body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 3}
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 401
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30, headers={"Authorization": "Bearer k3y"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        stats = httpx.get(url + "/v1/expertcache/stats", headers={"Authorization": "Bearer k3y"}, timeout=30)
        assert stats.json()["cache"]["policy"] == "lru+second-hit:ghost=32"
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn shuts down, the worker stops
        try:
            assert proc.wait(timeout=30) == 130  # the usual code for Ctrl-C (main() prints 'interrupted')
        finally:
            if proc.poll() is None:
                proc.kill()


def _refused(argv: list[str]) -> tuple[str, float]:
    """Run the CLI in a fresh interpreter; (stderr, seconds). It must exit 2 without importing torch:
    nothing was loaded."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}" + os.environ.get("PYTHONPATH", "")}
    code = ("import sys; from expertcache.cli import main; rc = main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(rc)")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
                         timeout=60)
    seconds = time.perf_counter() - start
    assert run.returncode == 2 and run.stdout.strip() == "False", (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
    return run.stderr, seconds


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "port must be a whole number in 0-65535"),
    (["--port", "-1"], "port must be a whole number in 0-65535"),
    (["--host", "no-such-host.invalid"], "the name does not resolve"),
    (["--host", "203.0.113.7"], "is not an address of this machine"),  # TEST-NET-3: nobody's
])
def test_bad_listen_address_is_refused_before_loading(tmp_path, flags, message):
    err, seconds = _refused(["serve", str(tmp_path / "no-model"), "--slots", "8", *flags])
    assert message in err
    assert seconds < 10  # loose on a loaded machine; about 0.5 s when quiet (issue 17: under 2 s)


def test_a_port_in_use_is_refused_before_loading(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err, seconds = _refused(["serve", str(tmp_path / "no-model"), "--slots", "8", "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}: the port is already in use" in err
    assert seconds < 10
