"""An HTTP proxy on 127.0.0.1 that forwards every request to a server (moto's S3) without
its conditional headers (`If-None-Match`, `If-Match`): an S3-compatible store that ignores
conditional writes, as some older ones do."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DROPPED = {"if-none-match", "if-match"}


def start_proxy(target_port: int) -> ThreadingHTTPServer:
    """A proxy to 127.0.0.1:`target_port` on a port of its own (`server_address[1]`);
    `shutdown()` stops it."""

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in DROPPED}
            conn = http.client.HTTPConnection("127.0.0.1", target_port, timeout=30)
            conn.request(self.command, self.path, body=body, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
            self.send_response(reply.status)
            for key, value in reply.getheaders():
                if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        def log_message(self, *args: object) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
