"""The node's tiny HTTP server: ``/metrics`` (Prometheus text), ``/healthz``, ``/readyz``, and
``/status`` (one JSON object: stage, state, version, loss, tokens/s, microbatch round trips).

It runs in its own thread: a scrape must answer even while the event loop is busy, and
``/healthz`` is exactly the check that the event loop is *not* stuck: the loop stamps a
heartbeat every second and ``/healthz`` fails when the stamp is older than ``stall_after`` s.
``/readyz`` is 200 only while the node is ``online`` (joined, state downloaded, serving).
"""

from __future__ import annotations

import errno
import json
import logging
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from node.ops.metrics import NodeMetrics

log = logging.getLogger("swarm_node.metrics")

# a client that stops sending its request or reading the answer holds its thread at most this long
HTTP_TIMEOUT_S = 10.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A request that failed: a client that went away or stalled past ``HTTP_TIMEOUT_S`` is
        routine (debug); anything else is logged with its traceback (not printed to stderr)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (TimeoutError, ConnectionError)):
            log.debug("metrics client %s: %r", client_address[0], exc)
        else:
            log.warning("metrics request from %s failed", client_address[0], exc_info=True)


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on a thread; ``port=0`` picks a free port."""

    def __init__(self, metrics: NodeMetrics, host: str = "127.0.0.1", port: int = 9100,
                 stall_after: float = 15.0):
        self.metrics = metrics
        self.stall_after = stall_after
        self.ready = False
        self.state = "starting"
        self.heartbeat = time.monotonic()
        self.details: dict = {}
        self.status_fn = None  # () -> dict for /status (the runtime's view: stage, version, loss, rtt, ...)
        owner = self

        class Handler(BaseHTTPRequestHandler):
            timeout = HTTP_TIMEOUT_S  # the connection's socket timeout (socketserver.StreamRequestHandler)

            def do_GET(self):  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, status, ctype = owner.metrics.render(), 200, CONTENT_TYPE_LATEST
                elif path == "/healthz":
                    age = time.monotonic() - owner.heartbeat
                    ok = age < owner.stall_after
                    body = json.dumps({"ok": ok, "loop_heartbeat_age_s": round(age, 3),
                                       "state": owner.state}).encode()
                    status, ctype = (200 if ok else 503), "application/json"
                elif path == "/status":
                    try:
                        info = owner.status_fn() if owner.status_fn is not None else {}
                    except Exception as e:  # noqa: BLE001 - a status page must not take the server down
                        info = {"error": repr(e)}
                    body = json.dumps({"state": owner.state, **info}).encode()
                    status, ctype = 200, "application/json"
                elif path == "/readyz":
                    body = json.dumps({"ready": owner.ready, "state": owner.state, **owner.details}).encode()
                    status, ctype = (200 if owner.ready else 503), "application/json"
                else:
                    body, status, ctype = b"not found: try /metrics, /healthz, /readyz, /status\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes are not log lines
                pass

        try:
            self._server = _Server((host, port), Handler)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(host, port) from None
            raise
        self.port = self._server.server_address[1]
        self.host = host
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat(self) -> None:
        self.heartbeat = time.monotonic()

    def set_state(self, state: str) -> None:
        self.state = state
        self.ready = state == "online"
        self.metrics.set_state(state)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class PortInUse(OSError):
    def __init__(self, host: str, port: int):
        super().__init__(errno.EADDRINUSE, f"{host}:{port} is in use")
        self.host, self.port = host, port
