"""The P/D proxy (`tract.integrations.vllm_proxy`) against stand-in
instances that record what they are sent (no vLLM needed)."""

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tract.integrations.vllm_proxy import ProxyServer


class Instance(ThreadingHTTPServer):
    """Answers every POST with ``answer`` (status, body) and records it."""

    def __init__(self, name, log, status=200):
        self.name, self.log, self.status = name, log, status

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(handler):
                body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
                log.append((name, handler.path, body))
                answer = json.dumps({"from": name, "n": len(log)}).encode()
                handler.send_response(self.status)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Content-Length", str(len(answer)))
                handler.end_headers()
                handler.wfile.write(answer)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def setup():
    log = []
    servers = {"prefill": Instance("prefill", log), "decode": Instance("decode", log)}
    proxy = ProxyServer(("127.0.0.1", 0), [servers["prefill"].url], [servers["decode"].url])
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield log, servers, f"http://127.0.0.1:{proxy.server_address[1]}"
    proxy.shutdown()
    for server in servers.values():
        server.shutdown()


def _post(url, body):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, json.loads(response.read())


def test_prefill_first_with_one_token_then_decode_unchanged(setup):
    log, _, url = setup
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}}
    status, answer = _post(url + "/v1/completions", body)
    assert status == 200 and answer["from"] == "decode"
    (first, path, sent), (second, path2, sent2) = log
    assert (first, second) == ("prefill", "decode") and path == path2 == "/v1/completions"
    assert sent["max_tokens"] == 1 and sent["stream"] is False and "stream_options" not in sent
    assert sent2 == body


def test_a_failed_prefill_is_returned_and_decode_never_called(setup):
    log, servers, url = setup
    servers["prefill"].status = 503
    with pytest.raises(urllib.error.HTTPError) as error:
        _post(url + "/v1/chat/completions", {"messages": [], "max_completion_tokens": 5})
    assert error.value.code == 503
    assert [name for name, *_ in log] == ["prefill"] and log[0][2]["max_completion_tokens"] == 1


def test_bad_bodies_and_routes_are_refused(setup):
    log, _, url = setup
    with pytest.raises(urllib.error.HTTPError) as error:
        _post(url + "/v1/completions", b"not json")
    assert error.value.code == 400 and b"not a JSON object" in error.value.read()
    with pytest.raises(urllib.error.HTTPError) as error:
        _post(url + "/v1/embeddings", {})
    assert error.value.code == 404 and not log


def test_the_proxy_needs_both_kinds_of_instance():
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        ProxyServer(("127.0.0.1", 0), [], ["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="is not http://HOST"):
        ProxyServer(("127.0.0.1", 0), ["ftp://x"], ["http://127.0.0.1:1"])
