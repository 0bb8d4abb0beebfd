"""`agl-lab serve --ssl-certfile/--ssl-keyfile`: HTTPS that the trainer's client and the runner verify.

A CA and a server certificate for 127.0.0.1 are made in the test (cryptography). A real `agl-lab
serve` serves HTTPS on loopback; the trainer's `AglClient` (SSL_CERT_FILE) creates rollouts, a
real `agl-lab runner --ssl-ca-file` runs them (its agents post events over HTTPS too), and a
client or runner without the CA fails at once naming SSL_CERT_FILE / the certificate, not after
retries.
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
