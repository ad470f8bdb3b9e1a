"""A minimal P/D proxy in front of vLLM instances that share a tract pool.

Each completion request goes first to a prefill instance with
``max_tokens=1`` (its connector stores the prompt's blocks in the pool),
then, unchanged, to a decode instance (its connector finds the blocks by
their block hashes and loads them): no KV and no transfer parameters pass
through the proxy.  Instances of each kind are taken in turn.  The
decode request is sent once the prefill answered, so the prefill instances
store inside their step (``"async_saves": false`` in their
``kv_connector_extra_config``): a store still queued when the answer goes
out would be a miss the decode instance recomputes.

    python -m tract.integrations.vllm_proxy --port 8000 \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the
decode instance's answer, streamed through as it comes) and forwards
``GET /v1/models`` to a decode instance.  Standard library only; a
prefill failure is returned to the client as it came, and the request is
not sent on.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["ProxyServer", "main"]

ROUTES = ("/v1/completions", "/v1/chat/completions")
_CHUNK = 1 << 16


def _split(url: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ValueError(f"instance URL {url!r} is not http://HOST[:PORT]")
    return parsed.hostname, parsed.port or 80


class ProxyServer(ThreadingHTTPServer):
    """The proxy: prefill URLs and decode URLs, each taken round-robin."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: list[str], decode: list[str],
                 timeout: float = 600.0):
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        self.prefill = itertools.cycle([_split(url) for url in prefill])
        self.decode = itertools.cycle([_split(url) for url in decode])
        self.timeout = timeout
        self._turn = threading.Lock()
        super().__init__(address, _Handler)

    def next(self, kind: str) -> tuple[str, int]:
        with self._turn:
            return next(self.prefill if kind == "prefill" else self.decode)


class _Handler(BaseHTTPRequestHandler):
    server: ProxyServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"error": {"message": message}}).encode())

    def _upstream(self, kind: str, method: str, body: bytes | None):
        host, port = self.server.next(kind)
        connection = http.client.HTTPConnection(host, port, timeout=self.server.timeout)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.headers.get("Authorization"):
            headers["Authorization"] = self.headers["Authorization"]
        connection.request(method, self.path, body=body, headers=headers)
        return connection, connection.getresponse()

    def _relay(self, connection, response) -> None:
        """The upstream answer to the client, chunk by chunk as it comes."""
        try:
            self.send_response(response.status)
            self.send_header("Content-Type", response.getheader("Content-Type",
                                                                "application/json"))
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := response.read1(_CHUNK):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            connection.close()

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path != "/v1/models":
            return self._error(404, f"no route {self.path}")
        try:
            self._relay(*self._upstream("decode", "GET", None))
        except OSError as error:
            self._error(502, f"decode instance unreachable: {error}")

    def do_POST(self):  # noqa: N802
        if self.path not in ROUTES:
            return self._error(404, f"no route {self.path}; the proxy serves {', '.join(ROUTES)}")
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            request = json.loads(raw)
            if not isinstance(request, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as error:
            return self._error(400, f"request body is not a JSON object: {error}")
        prefill = dict(request, max_tokens=1, stream=False)
        prefill.pop("stream_options", None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        try:
            connection, response = self._upstream("prefill", "POST",
                                                  json.dumps(prefill).encode())
            try:
                answer = response.read()
            finally:
                connection.close()
            if response.status != 200:
                return self._send(response.status, answer,
                                  response.getheader("Content-Type", "application/json"))
        except OSError as error:
            return self._error(502, f"prefill instance unreachable: {error}")
        try:
            self._relay(*self._upstream("decode", "POST", raw))
        except OSError as error:
            self._error(502, f"decode instance unreachable: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tract.integrations.vllm_proxy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", action="append", required=True,
                        help="a prefill instance's URL (repeat for several)")
    parser.add_argument("--decode", action="append", required=True,
                        help="a decode instance's URL (repeat for several)")
    args = parser.parse_args(argv)
    server = ProxyServer((args.host, args.port), args.prefill, args.decode)
    print(f"tract P/D proxy on http://{args.host}:{server.server_address[1]}: prefill "
          f"{', '.join(args.prefill)}; decode {', '.join(args.decode)}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
