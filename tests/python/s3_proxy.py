"""A fault-injecting HTTP proxy in front of the S3 test server (moto), on loopback only.

It forwards every request byte for byte (headers included, so signatures still match) and
numbers them; for one chosen request it can STALL (hold it until released or until the
client goes away: the test kills the client meanwhile) or FAIL it without forwarding it: `fail`
answers 500 InternalError (which clients retry), `deny` 403 AccessDenied (which they do not). `arrived` is set when the chosen request comes in, so tests wait on that event, not
on a timer.
"""

from __future__ import annotations

import http.client
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# What a FAILed request gets: a 500 (clients retry it) or a 403 (they do not).
FAILURES = {
    "fail": (500, b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                  b"<Message>injected failure</Message></Error>"),
    "deny": (403, b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
                  b"<Message>injected denial</Message></Error>"),
}


class S3Proxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.fault_at: int | None = None  # 1-based index of the request to fault
        # Or the nth request whose method and path match: (method, substring of the path, n).
        self.fault_match: tuple[str, str, int] | None = None
        self.matched = 0
        self.fault: str = "stall"  # or a key of FAILURES
        self.arrived = threading.Event()
        self.release = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.requests.append((self.command, self.path))
                    index = len(proxy.requests)
                    hit = index == proxy.fault_at
                    m = proxy.fault_match
                    if m and self.command == m[0] and m[1] in self.path:
                        proxy.matched += 1
                        hit = hit or proxy.matched == m[2]
                if hit:
                    proxy.arrived.set()
                    if proxy.fault in FAILURES:
                        status, body = FAILURES[proxy.fault]
                        self.send_response(status)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        # A HEAD's answer has no body: bytes written anyway would stay on the
                        # kept-alive connection and corrupt the client's next response there.
                        if self.command != "HEAD":
                            self.wfile.write(body)
                        return
                    # Stalled: held until released (the client is killed meanwhile).
                    proxy.release.wait(120)
                    self.close_connection = True
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                # A HEAD's length is the object's, not its (empty) body's.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def arm(self, index: int | None, fault: str = "stall", match: tuple[str, str, int] | None = None) -> None:
        """Faults request `index` (1-based, counted from now), or the `n`th request of `method`
        whose path contains `part` (`match=(method, part, n)`); neither: no fault."""
        with self.lock:
            self.requests.clear()
            self.fault_at, self.fault, self.fault_match, self.matched = index, fault, match, 0
            self.arrived.clear()
            self.release.clear()

    def count(self) -> int:
        with self.lock:
            return len(self.requests)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
