"""The client's failure modes on real sockets on loopback (issue 53 items 4, 8, 12, 14).

- A server that drops packets: a listening socket whose accept queue is full (listen(0), never
  accepted, filled with connections) lets no new connection complete, so connecting times out as
  it does for a black-holed host. The client leaves it for the next server within its connect
  timeout, and a call that reaches no server fails after `unreachable_seconds`, not the retry budget.
- A web page on the server's URL: one error naming the URL, status, content type and first bytes.
- The wrong scheme: https:// to a plain server, http:// to a TLS `agl-lab serve` (a self-signed
  certificate made here); `agl-lab runner --server` with either, or with the web page, exits 2
  with one line instead of retrying for ever.
- `agl-lab runner --ray HOST:PORT` where nothing listens: one line, exit 2, after
  `--ray-connect-timeout`.
"""

from __future__ import annotations

import contextlib
import datetime
import http.server
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agl_lab.client import AglClient, AglConnectionError, AglWrongServer
from agl_lab.protocol import RolloutCreate
from tests.processes import ROOT, cli_env, free_port, healthy, spawn_cli, stop_groups, wait_for

KEY = "failures-key"
PAGE = b"<!DOCTYPE html><html><body>Welcome to nginx!</body></html>"


@contextlib.contextmanager
def dropping_server() -> Iterator[str]:
    """The URL of a port that never completes a connection (its accept queue full: SYNs dropped)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):  # backlog 0 queues one; the rest wait in SYN-sent; more is harmless
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        with pytest.raises(httpx.ConnectTimeout):  # the premise: connecting times out here
            httpx.get(f"http://127.0.0.1:{port}/", timeout=httpx.Timeout(5, connect=0.5))
        yield f"http://127.0.0.1:{port}"
    finally:
        for sock in [*fillers, listener]:
            sock.close()


@contextlib.contextmanager
def web_page_server() -> Iterator[str]:
    """A plain web server answering every GET with an HTML page (200, text/html)."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(PAGE)))
            self.end_headers()
            self.wfile.write(PAGE)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[str]:
    """`agl-lab serve` on https:// with a self-signed certificate for 127.0.0.1; yields host:port."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    port, log = free_port(), tmp_path / "serve.log"
    flags = ["--ssl-certfile", str(tmp_path / "cert.pem"), "--ssl-keyfile", str(tmp_path / "key.pem")]
    proc = spawn_cli(["serve", "--port", str(port), "--model-name", "m", *flags], log, AGL_KEY=KEY)
    try:
        wait_for(lambda: _tls_healthy(port), 60, "the TLS server", procs=[proc], logs=[log])
        yield f"127.0.0.1:{port}"
    finally:
        stop_groups([proc])


def _tls_healthy(port: int) -> bool:
    try:
        return httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run_runner(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`agl-lab runner *argv` to its end (each case here must end by itself, exit 2)."""
    cmd = [
        sys.executable,
        "-m",
        "agl_lab.cli",
        "runner",
        "--key",
        KEY,
        "--agent",
        "tests.agents_for_tests:remote_agent",
    ]
    return subprocess.run([*cmd, *argv], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=timeout)


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("agl-lab runner")]


# =============================================================================================
# Item 4: a server that drops packets
# =============================================================================================


def test_a_server_that_drops_packets_is_left_for_the_next_within_the_connect_timeout(embedded_server):
    live = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    sent: list[httpx.Request] = []
    with dropping_server() as dead:
        with AglClient(f"{dead},{live.url}", key=KEY, connect_timeout=0.5, event_hooks={"request": [sent.append]}) as c:
            c.create_rollouts([RolloutCreate(rollout_id="r0", input={})])
            assert c.base_url == live.url and c.failovers == 1
            # one try on the dead server, then the live one: no retry of the connect timeout
            assert [str(r.url).split("/api")[0] for r in sent] == [dead, live.url]
            assert c.get_rollout("r0")[0].rollout_id == "r0"


def test_a_call_that_reaches_no_server_fails_after_unreachable_seconds_not_the_retry_budget():
    sent: list[httpx.Request] = []
    with dropping_server() as dead:
        client = AglClient(
            dead, connect_timeout=0.5, unreachable_seconds=4, backoff_base=0.5, event_hooks={"request": [sent.append]}
        )  # 4 s: a second send fits even when a loaded host stalls the first by a second or two
        with client, pytest.raises(AglConnectionError, match=rf"cannot reach the agl server at {dead} .* in [\d.]+ s"):
            client.healthz()
    # attempt 1 ends at ~0.5 s, waits 0.5; attempt 2 ends at ~1.5 s, waits 1; attempt 3 ends at ~3 s
    assert 2 <= len(sent) < 11


def test_the_trainers_client_defaults_connect_in_seconds_and_give_up_on_no_server_in_seconds():
    with AglClient("http://127.0.0.1:9") as client:  # the trainer's AglClient(urls, key=...)
        assert client.http.timeout.connect == 5.0 and client.http.timeout.read == 120.0
        assert client._policy.unreachable_seconds == 30.0
    with pytest.raises(ValueError, match="unreachable_seconds must be > 0"):
        AglClient("http://127.0.0.1:9", unreachable_seconds=0)


# =============================================================================================
# Items 8 and 12: a web page, the wrong scheme
# =============================================================================================


def test_a_web_page_on_the_servers_url_is_named_once_not_retried():
    sent: list[httpx.Request] = []
    with web_page_server() as url, AglClient(url, event_hooks={"request": [sent.append]}) as client:
        with pytest.raises(AglWrongServer) as caught:
            client.list_rollouts(["queuing"])
    message = str(caught.value)
    assert message.startswith(f"{url}/api/rollouts answered 200 text/html, not JSON: b'<!DOCTYPE html>")
    assert "not an agl_lab / Agent Lightning server" in message and len(sent) == 1


def test_https_to_a_plain_server_and_http_to_a_tls_server_say_which_scheme(embedded_server, tls_server):
    plain = embedded_server(key=KEY, default_proxy={"model_name": "m"}).url.split("://")[1]
    sent: list[httpx.Request] = []
    with AglClient(f"https://{plain}", key=KEY, event_hooks={"request": [sent.append]}) as client:
        with pytest.raises(
            AglWrongServer, match=rf"^https://{plain} answered the TLS handshake in plain HTTP .*use http://{plain}"
        ):
            client.healthz()
    with AglClient(f"http://{tls_server}", key=KEY, event_hooks={"request": [sent.append]}) as client:
        with pytest.raises(AglWrongServer, match=rf"^http://{tls_server} is a TLS port .*: use https://{tls_server}$"):
            client.healthz()
    assert len(sent) == 2  # one try each


def test_the_runner_exits_2_with_one_line_on_the_wrong_scheme_or_a_web_page(embedded_server, tls_server):
    plain = embedded_server(key=KEY, default_proxy={"model_name": "m"}).url.split("://")[1]
    with web_page_server() as page:
        cases = {
            f"https://{plain}": "not a TLS port",
            f"http://{tls_server}": f"use https://{tls_server}",
            page: "not an agl_lab / Agent Lightning server",
        }
        for url, words in cases.items():
            result = run_runner("--server", url)
            assert result.returncode == 2, (url, result.stdout, result.stderr)
            assert len(error_lines(result)) == 1 and words in error_lines(result)[0], (url, result.stderr)
            assert "Traceback" not in result.stderr and "retrying" not in result.stdout


# =============================================================================================
# Item 14: runner --ray at an address where no Ray head listens
# =============================================================================================


def test_runner_ray_at_an_unused_address_exits_2_after_its_connect_timeout(embedded_server):
    pytest.importorskip("ray")
    server = embedded_server(key=KEY, default_proxy={"model_name": "m"})
    assert healthy(server.url)
    address = f"127.0.0.1:{free_port()}"
    result = run_runner("--server", server.url, "--ray", address, "--ray-connect-timeout", "2", timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    (line,) = error_lines(result)
    assert line.startswith(f"agl-lab runner: could not start: no Ray head answers at {address} within 2 s")
    assert "--ray-connect-timeout" in line
    bad = run_runner("--server", server.url, "--ray", address, "--ray-connect-timeout", "0")
    assert bad.returncode == 2 and "--ray-connect-timeout must be > 0 seconds, got 0.0" in bad.stderr
