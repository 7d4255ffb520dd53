"""Token authentication and TLS from Python: ``rp.AuthError`` says why, and the
token and CA come from arguments or the environment."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import rallypoint as rp

TOKEN = "python-test-token-0123456789abcdef"


@pytest.fixture
def guarded():
    co = rp._Coordinator(token=TOKEN)
    yield co
    co.shutdown()


@pytest.fixture
def no_auth_env(monkeypatch):
    for name in ("RALLYPOINT_TOKEN", "RALLYPOINT_TOKEN_FILE", "RALLYPOINT_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_missing_or_wrong_token_is_an_auth_error_saying_what_to_set(guarded, no_auth_env):
    with pytest.raises(rp.AuthError) as missing:
        rp.Client(guarded.addr, timeout=30)
    assert missing.value.reason == "token_required"
    assert "set RALLYPOINT_TOKEN or RALLYPOINT_TOKEN_FILE" in str(missing.value)
    assert isinstance(missing.value, rp.RallypointError) and isinstance(missing.value, PermissionError)
    assert missing.value.addr == guarded.addr
    with pytest.raises(rp.AuthError) as wrong:
        rp.Client(guarded.addr, token="not-the-token", timeout=30)
    assert wrong.value.reason == "wrong_token"


def test_the_token_comes_from_an_argument_or_the_environment(guarded, no_auth_env, tmp_path, job):
    with rp.Client(guarded.addr, job=job, token=TOKEN, timeout=30) as c:
        c.set("k", "v")
    no_auth_env.setenv("RALLYPOINT_TOKEN", TOKEN)
    with rp.Client(guarded.addr, job=job, timeout=30) as c:
        assert c.get("k") == b"v"
    # A token file wins over the variable, and must be private.
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    no_auth_env.setenv("RALLYPOINT_TOKEN", "ignored")
    no_auth_env.setenv("RALLYPOINT_TOKEN_FILE", str(path))
    with pytest.raises(rp.InvalidArgument, match="chmod 600"):
        rp.Client.from_env(addr=guarded.addr, job=job, timeout=30)
    path.chmod(0o600)
    with rp.Client.from_env(addr=guarded.addr, job=job, timeout=30) as c:
        assert c.get("k") == b"v"


def test_a_client_with_a_token_refuses_a_coordinator_without_one(coordinator, no_auth_env):
    with pytest.raises(rp.AuthError) as refused:
        rp.Client(coordinator.addr, token=TOKEN, timeout=30)
    assert refused.value.reason == "no_token_here"


@pytest.fixture
def pki(tmp_path):
    """A CA and a certificate it signed for 127.0.0.1, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificates")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=rallypoint test CA")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", "key.pem", "-out", "cert.csr", "-subj", "/CN=127.0.0.1")
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "cert.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "cert.pem", "-days", "1", "-extfile", "ext.cnf")
    return tmp_path


def test_tls_round_trip_and_plaintext_refused(pki, no_auth_env, job):
    co = rp._Coordinator(token=TOKEN, tls_cert=str(pki / "cert.pem"), tls_key=str(pki / "key.pem"))
    try:
        with rp.Client(co.addr, job=job, token=TOKEN, tls_ca=str(pki / "ca.pem"), timeout=30) as c:
            c.set("k", "over TLS")
        no_auth_env.setenv("RALLYPOINT_TLS_CA", str(pki / "ca.pem"))
        with rp.Client.from_env(addr=co.addr, job=job, token=TOKEN, timeout=30) as c:
            assert c.get("k") == b"over TLS"
        no_auth_env.delenv("RALLYPOINT_TLS_CA")
        with pytest.raises(rp.AuthError) as plain:
            rp.Client(co.addr, token=TOKEN, timeout=30)
        assert plain.value.reason == "tls_required"
        assert "requires TLS" in str(plain.value)
    finally:
        co.shutdown()


def test_a_certificate_no_client_would_take_is_refused_at_start(pki):
    # Signed without -extfile: an X.509 v1 certificate, without subjectAltName.
    subprocess.run(["openssl", "x509", "-req", "-in", "cert.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                    "-CAcreateserial", "-out", "v1.pem", "-days", "1"], check=True, capture_output=True, cwd=pki)
    with pytest.raises(rp.InvalidArgument, match=r"is an X\.509 v1 one .*-extfile"):
        rp._Coordinator(tls_cert=str(pki / "v1.pem"), tls_key=str(pki / "key.pem"))


def test_spawned_workers_prove_the_token_of_their_coordinator(no_auth_env):
    # A token of another coordinator in the parent's environment does not leak into them.
    no_auth_env.setenv("RALLYPOINT_TOKEN", "a-token-of-something-else")
    assert rp.spawn(_sum_of_ranks, nprocs=2) == [1, 1]


def _sum_of_ranks() -> int:
    with rp.Client.from_env() as c:
        return sum(int(v) for v in c.all_gather(str(c.rank).encode()))
