"""TRL's client retries a request whose connection the server reset; the wider connection pool that streamed
generation mounts (one connection per request in flight) must keep those retries."""
import json
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ogrpo.serve.client import _widen_pool


class ResetOnce(BaseHTTPRequestHandler):
    posts = 0

    def log_message(self, *args):
        pass

    def do_GET(self):  # TRL's client checks /health and asks /v1/models when it is made
        self._answer({"data": [{"id": "tiny"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).posts += 1
        if type(self).posts == 1:  # as a keep-alive connection closed by the server under a request: a reset
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        self._answer({"ok": True})

    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    ResetOnce.posts = 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ResetOnce)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_reset_connection_is_retried_through_the_widened_pool(server):
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=server, connection_timeout=10)
    _widen_pool(client, 64)
    adapter = client.session.get_adapter(server)
    assert adapter._pool_maxsize == 64 and adapter.max_retries.total > 0
    assert client._post(f"{server}/v1/completions", json={"prompt": [1]}) == {"ok": True}
    assert ResetOnce.posts == 2  # the first was reset and sent again
