"""The storage host of the multi-node test: serves a directory over HTTP with byte ranges on
``ADDRESS:PORT`` (stallfree.testing.httpserve) and its counters as JSON on ``ADDRESS:PORT+1``."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stallfree.testing.httpserve import serve_directory


def main(root: str, address: str, port: int) -> None:
    with serve_directory(root, host=address, port=port) as server:

        class Stats(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                s = server.stats
                body = json.dumps({"requests": s.requests, "bytes_sent": s.bytes_sent}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        stats = ThreadingHTTPServer((address, port + 1), Stats)
        threading.Thread(target=stats.serve_forever, daemon=True).start()
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
