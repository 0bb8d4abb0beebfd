"""`agl-lab serve --ssl-certfile/--ssl-keyfile`: HTTPS that the trainer's client and the runner verify.

A CA and a server certificate for 127.0.0.1 are made in the test (cryptography). A real `agl-lab
serve` serves HTTPS on loopback; the trainer's `AglClient` (SSL_CERT_FILE) creates rollouts, a
real `agl-lab runner --ssl-ca-file` runs them (its agents post events over HTTPS too), and a
client or runner without the CA fails at once naming SSL_CERT_FILE / the certificate, not after
retries. Files that do not load (a key of another certificate, not PEM, empty, a directory) stop
`serve` and `runner --ssl-ca-file` in one line naming the file, and a connection that never starts
its handshake is closed after `--header-timeout`, not held for asyncio's 60 s.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agl_lab.client import AglClient, AglConnectionError
from agl_lab.protocol import RolloutCreate

ROOT = Path(__file__).resolve().parents[1]
KEY = "tls-key"
AGENT = "tests.agents_for_tests:remote_agent"


def _make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key): a CA, and a certificate it signed for 127.0.0.1/localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agl-lab test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital_signature, key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    paths[2].chmod(0o600)  # a private key others may read is warned about
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agl_lab(*argv: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agl_lab.cli", *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "AGL_KEY": KEY, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """(https URL, ca.pem) of a real `agl-lab serve` with a certificate its CA signed."""
    ca, cert, key = _make_certificates(tmp_path_factory.mktemp("tls"))
    port = _free_port()
    proc = _agl_lab("serve", "--port", str(port), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    url = f"https://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, _stop(proc)
        try:
            if httpx.get(url + "/healthz", verify=str(ca), timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "agl-lab serve --ssl-certfile did not answer /healthz"
        time.sleep(0.2)
    yield url, ca
    _stop(proc)


def test_trainer_client_and_runner_verify_the_servers_certificate(tls_server, monkeypatch):
    url, ca = tls_server
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    with AglClient(url, key=KEY) as client:  # the trainer's client
        ids = [f"tls-{i}" for i in range(4)]
        client.create_rollouts([RolloutCreate(rollout_id=rid, input={"i": i}) for i, rid in enumerate(ids)])
        runner = _agl_lab(
            "runner", "--server", url, "--ssl-ca-file", str(ca), "--agent", AGENT, "--poll-interval", "0.05",
            SSL_CERT_FILE="",
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while {r.rollout_id for r in client.list_rollouts(["succeeded"])} != set(ids):
                assert runner.poll() is None, _stop(runner)
                assert time.monotonic() < deadline, "the runner did not finish the rollouts over HTTPS"
                time.sleep(0.2)
        finally:
            _stop(runner)
        for rid in ids:  # the agent's own event and its reward reached the server over HTTPS
            kinds = [e["event_type"] for e in client.http.get(f"/api/rollouts/{rid}/events").json()]
            assert "ran" in kinds and "reward" in kinds, kinds


def test_without_the_ca_client_and_runner_fail_at_once_naming_the_fix(tls_server, monkeypatch):
    url, _ = tls_server
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    sent: list[object] = []
    with AglClient(url, key=KEY, max_retries=5, event_hooks={"request": [sent.append]}) as client:
        with pytest.raises(AglConnectionError, match="SSL_CERT_FILE"):
            client.list_rollouts(["queuing"])
    assert len(sent) == 1  # not retried: the next attempt would meet the same certificate
    runner = _agl_lab("runner", "--server", url, "--agent", AGENT, SSL_CERT_FILE="")
    out = _stop(runner) if runner.wait(timeout=120) is not None else ""
    assert runner.returncode == 2 and "could not be verified" in out, out


def test_serve_refuses_half_a_tls_pair(tmp_path):
    proc = _agl_lab("serve", "--port", str(_free_port()), "--ssl-certfile", str(tmp_path / "x.pem"))
    out = _stop(proc) if proc.wait(timeout=120) is not None else ""
    assert proc.returncode != 0 and "--ssl-keyfile" in out, out


def test_tls_files_that_do_not_load_stop_start_up_in_one_line(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    _, cert, key = _make_certificates(tmp_path / "a")
    _, _, other_key = _make_certificates(tmp_path / "b")  # a key of another certificate
    garbage, empty = tmp_path / "garbage.pem", tmp_path / "empty.pem"
    garbage.write_text("not a certificate\n")
    empty.write_text("")
    cases = {  # (certificate, key) -> what the line must say
        (cert, other_key): f"--ssl-keyfile {other_key} is not the private key of --ssl-certfile {cert}",
        (garbage, key): f"--ssl-certfile {garbage} holds no PEM certificate",
        (cert, garbage): f"--ssl-keyfile {garbage} holds no private key that loads",
        (empty, key): f"--ssl-certfile {empty} is empty",
        (tmp_path / "a", key): f"--ssl-certfile {tmp_path / 'a'} is a directory",
    }
    procs = {
        case: _agl_lab(
            "serve", "--port", str(_free_port()), "--ssl-certfile", str(case[0]), "--ssl-keyfile", str(case[1])
        )
        for case in cases
    }
    procs["runner"] = _agl_lab("runner", "--server", f"https://127.0.0.1:{_free_port()}", "--ssl-ca-file", str(garbage))
    cases["runner"] = f"--ssl-ca-file {garbage} holds no PEM certificate"
    for case, proc in procs.items():
        out = _stop(proc) if proc.wait(timeout=120) is not None else ""
        assert proc.returncode == 2 and len(out.strip().splitlines()) == 1, (case, out)
        assert cases[case] in out, (case, out)


def test_a_connection_that_never_starts_its_tls_handshake_is_closed_after_the_header_timeout(tmp_path):
    ca, cert, key = _make_certificates(tmp_path)
    port = _free_port()
    proc = _agl_lab(
        "serve", "--port", str(port), "--header-timeout", "1", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)
    )
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, _stop(proc)
            try:
                if httpx.get(url + "/healthz", verify=str(ca), timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "agl-lab serve --ssl-certfile did not answer /healthz"
            time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as silent:  # connects, never says hello
            silent.settimeout(20)  # asyncio's own bound is 60 s: held that long, recv times out here
            try:
                closed = silent.recv(1) == b""
            except ConnectionResetError:
                closed = True
        assert closed
        assert httpx.get(url + "/healthz", verify=str(ca), timeout=5).status_code == 200  # others still served
    finally:
        _stop(proc)
