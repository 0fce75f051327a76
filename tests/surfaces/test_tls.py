"""Serving beyond loopback: `serve` with TLS on a non-`localhost` loopback address (127.0.0.2),
the self-signed certificate made in the state dir, the openai SDK pinning it, a wrong pin and
plain HTTP refused, the Host check with `--host-name`, `--insecure-http` witnessed, the bind
rule, and two daemons federating over TLS with the first one's certificate pinned.

Everything is real: the listener is `surfaces.http.serve` (the daemon's own start-up path), the
handshakes are OpenSSL's, the clients are the openai SDK (httpx) and aiohttp. The model server
is the in-process fake; nothing here binds beyond 127.0.0.0/8.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import ssl
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest
from cryptography.hazmat.primitives.serialization import Encoding
from pydantic import ValidationError

from daemon.remotes import verify_remote
from daemon.service import Daemon
from daemon.slots.discovery import connection_problem
from daemon.slots.process import free_port
from daemon.tls import bind_refusal, ensure_self_signed, fingerprint, is_loopback
from roster.loading import load_roster_text
from roster.models import Member
from surfaces.http import HttpOptions, Listen, parse_tcp, serve
from tests.runs.model_server import roster_toml, settings_for
from tests.slots.fake_server import FakeServer
from tests.surfaces.federation import TOKEN_ENV, run_through, second_roster

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.2"  # loopback, but not the address `localhost` names
NAME = "tally.test"  # the operator's --host-name


class Served:
    """One daemon listening on HOST over `serve`, until `close`."""

    def __init__(self, daemon: Daemon, port: int, cert: Path | None) -> None:
        self.daemon = daemon
        self.port = port
        self.cert = cert
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    @property
    def origin(self) -> str:
        return f"{'https' if self.cert else 'http'}://{HOST}:{self.port}"

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            await asyncio.wait_for(self.task, 30)


async def start_served(
    tmp: Path, roster_text: str, *, tls: bool = True, insecure_http: bool = False
) -> Served:
    await asyncio.to_thread(tmp.mkdir, parents=True, exist_ok=True)
    settings = settings_for(tmp, roster_text)
    daemon = Daemon(settings)
    pair = ensure_self_signed(settings.state_dir, [HOST, NAME]) if tls else None
    served = Served(daemon, free_port(), pair[0] if pair else None)
    listen = Listen(None, f"{HOST}:{served.port}", tls=pair, insecure_http=insecure_http)
    options = HttpOptions(host_names=(NAME,), keepalive_s=0.2)
    served.task = asyncio.create_task(serve(daemon, listen, options, stop=served.stop))
    for _ in range(400):
        if daemon.listener is not None:
            return served
        if served.task.done():
            served.task.result()  # raises what stopped it
        await asyncio.sleep(0.025)
    await served.close()
    pytest.fail("the daemon did not listen within 10 s")


@pytest.fixture
async def model() -> AsyncIterator[FakeServer]:
    server = FakeServer(slots=4, n_ctx=4096)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def served(tmp_path: Path, model: FakeServer) -> AsyncIterator[Served]:
    one = await start_served(tmp_path / "a", roster_toml(model.url))
    try:
        yield one
    finally:
        await one.close()


def pinned_context(cert: Path) -> ssl.SSLContext:
    """The self-signed certificate as its own CA, its IP SAN checked (what `--cacert` does)."""
    context = ssl.create_default_context(cafile=str(cert))
    assert context.check_hostname
    return context


def _pin(cert: Path) -> aiohttp.Fingerprint:
    return aiohttp.Fingerprint(bytes.fromhex(fingerprint(cert.read_bytes())[len("sha256:") :]))


# ---------------------------------------------------------------- the bind rule


def test_beyond_loopback_plain_http_is_refused_unless_asked() -> None:
    for host in ("127.0.0.1", HOST, "::1", "[::1]", "localhost", "127.255.0.9", "::ffff:127.0.0.1"):
        assert is_loopback(host)
        assert bind_refusal(host, tls=False, insecure_http=False) is None
    for host in (
        *("0.0.0.0", "::", "172.17.0.1", "192.168.1.20", "::ffff:10.0.0.1"),
        *("tally.example", "localhost.evil"),
    ):
        assert not is_loopback(host)
        refusal = bind_refusal(host, tls=False, insecure_http=False)
        assert refusal is not None
        assert "--tls" in refusal
        assert "--insecure-http" in refusal
        assert bind_refusal(host, tls=True, insecure_http=False) is None
        assert bind_refusal(host, tls=False, insecure_http=True) is None
    # what `serve` and `unit` parse: loopback only unless the caller says TLS or insecure
    with pytest.raises(ValueError, match="not a loopback address"):
        parse_tcp("0.0.0.0:8443")
    assert parse_tcp("[::]:8443", tls=True) == ("::", 8443)
    assert parse_tcp("172.17.0.1:80", insecure_http=True) == ("172.17.0.1", 80)
    assert parse_tcp(f"{HOST}:80") == (HOST, 80)


async def test_tally_serve_refuses_a_non_loopback_bind_before_starting(tmp_path: Path) -> None:
    """The CLI refuses before it binds or opens the ledger (nothing is bound here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "surfaces", "serve", "--tcp", "172.17.0.1:8443",
        "--state", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock"),
        env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"not a loopback address" in err
    assert b"--insecure-http" in err
    assert not (tmp_path / "state").exists()  # refused before anything started


# ---------------------------------------------------------------- the certificate


async def test_the_self_signed_certificate_and_tally_cert(served: Served) -> None:
    from cryptography import x509

    assert served.cert is not None
    key = served.cert.with_name("key.pem")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate(served.cert.read_bytes())
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == [HOST]
    assert san.get_values_for_type(x509.DNSName) == [NAME]
    pin = fingerprint(served.cert.read_bytes())
    der = cert.public_bytes(Encoding.DER)
    assert pin == "sha256:" + hashlib.sha256(der).hexdigest()
    # kept across starts: the same names reuse it, so a pinned fingerprint stays valid
    assert ensure_self_signed(served.daemon.settings.state_dir, [HOST, NAME])[0] == served.cert
    assert fingerprint(served.cert.read_bytes()) == pin
    # `tally cert` prints it and its pin; `health` names the same
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "surfaces", "cert", "--state",
        str(served.daemon.settings.state_dir),
        env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    text = out.decode()
    assert text.startswith("-----BEGIN CERTIFICATE-----")
    assert text.strip().endswith(pin)
    listener = served.daemon.listener
    assert listener is not None
    assert listener.tls
    assert listener.tls_fingerprint == pin
    assert listener.url == f"https://{NAME}:{served.port}"
    assert not listener.insecure_http


# ---------------------------------------------------------------- clients


async def test_the_openai_sdk_with_the_certificate_pinned(served: Served) -> None:
    assert served.cert is not None
    token = served.daemon.clients.add("app", "submit")
    async with httpx.AsyncClient(verify=pinned_context(served.cert), timeout=30) as http:
        client = openai.AsyncOpenAI(
            base_url=f"{served.origin}/v1", api_key=token, http_client=http, max_retries=0
        )
        models = await client.models.list()
        assert any(m.id == "tier:cheap" for m in models.data)
        reply = await client.chat.completions.create(
            model="tier:cheap", messages=[{"role": "user", "content": "hello"}], max_tokens=16
        )
        assert reply.choices[0].message.content
        # the same daemon, through its listed name (the certificate covers it)
        resolved = await http.get(
            f"{served.origin}/healthz", headers={"Host": f"{NAME}:{served.port}"}
        )
        assert resolved.status_code == 200


async def test_a_wrong_certificate_is_refused(served: Served, tmp_path: Path) -> None:
    assert served.cert is not None
    right = _pin(served.cert)
    wrong = aiohttp.Fingerprint(hashlib.sha256(b"another certificate").digest())
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{served.origin}/healthz", ssl=right) as resp:
            assert resp.status == 200
        with pytest.raises(aiohttp.ServerFingerprintMismatch) as mismatch:
            await http.get(f"{served.origin}/healthz", ssl=wrong)
        # what a member's status and the member check say
        said = connection_problem(mismatch.value, served.origin, 5)
        assert said.endswith("is not the pinned tls_fingerprint"), said
        assert fingerprint(served.cert.read_bytes()) in said
        # no pin and no CA: the system's CAs do not vouch for a self-signed certificate
        with pytest.raises(aiohttp.ClientConnectorCertificateError) as unverified:
            await http.get(f"{served.origin}/healthz")
        assert "set tls_fingerprint or tls_ca" in connection_problem(unverified.value, "u", 5)
    # the openai SDK trusting another self-signed certificate (same names) is refused too
    other, _ = ensure_self_signed(tmp_path / "other", [HOST, NAME])
    async with httpx.AsyncClient(verify=pinned_context(other), timeout=10) as http:
        client = openai.AsyncOpenAI(
            base_url=f"{served.origin}/v1", api_key="x", http_client=http, max_retries=0
        )
        with pytest.raises(openai.APIConnectionError):
            await client.models.list()


async def test_plain_http_to_the_tls_port_gets_no_http_answer(served: Served) -> None:
    def exchange() -> bytes:
        with socket.create_connection((HOST, served.port), timeout=10) as sock:
            sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {HOST}:{served.port}\r\n\r\n".encode())
            chunks = []
            while True:
                try:
                    chunk = sock.recv(4096)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks)

    answer = await asyncio.to_thread(exchange)
    assert not answer.startswith(b"HTTP/")  # a TLS alert at most, then the connection closes
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            await http.get(f"http://{HOST}:{served.port}/healthz")


async def test_host_names_listed_are_accepted_and_rebinding_names_refused(
    served: Served,
) -> None:
    assert served.cert is not None
    pin = _pin(served.cert)
    token = served.daemon.clients.add("reader", "read")
    auth = {"Authorization": f"Bearer {token}"}
    port = served.port
    async with aiohttp.ClientSession() as http:

        async def status(host: str, origin: str | None = None) -> int:
            headers = auth | {"Host": host} | ({"Origin": origin} if origin else {})
            url = f"{served.origin}/v1/tools"
            async with http.get(url, headers=headers, ssl=pin) as resp:
                return resp.status

        for host in (f"{NAME}:{port}", NAME, f"{HOST}:{port}", f"localhost:{port}"):
            assert await status(host) == 200, host
        for host in (f"evil.example:{port}", f"{NAME}.evil.example:{port}", f"127.0.0.3:{port}"):
            assert await status(host) == 421, host
        assert await status(f"{NAME}:{port}", f"https://{NAME}:{port}") == 200
        assert await status(f"{NAME}:{port}", f"https://{HOST}:{port}") == 200
        assert await status(f"{NAME}:{port}", f"https://evil.example:{port}") == 403
        assert await status(f"{NAME}:{port}", f"https://{NAME}:{port + 1}") == 403
        assert await status(f"{NAME}:{port}", f"https://{NAME}") == 403


async def test_insecure_http_is_witnessed_and_shown_in_health(
    tmp_path: Path, model: FakeServer
) -> None:
    from daemon.clients import OWNER
    from daemon.tools import TOOLS
    from daemon.tools.tool import Empty, ToolContext

    one = await start_served(tmp_path / "a", roster_toml(model.url), tls=False, insecure_http=True)
    try:
        [entry] = await one.daemon.ledger.entries(limit=100, kind="serve.insecure_http")
        body = (await one.daemon.ledger.body(entry.body)).value
        assert body["url"] == f"http://{NAME}:{one.port}"
        health = await TOOLS["health"].handler(one.daemon, Empty(), ToolContext(client=OWNER))
        assert health.listener is not None
        assert health.listener.insecure_http
        assert not health.listener.tls
        async with aiohttp.ClientSession() as http, http.get(f"{one.origin}/healthz") as resp:
            assert resp.status == 200
    finally:
        await one.close()


async def test_client_add_prints_what_a_client_needs(served: Served) -> None:
    """With the daemon stopped the command reads the state dir's certificate."""
    assert served.cert is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "surfaces", "client", "add", "ide", "--scope", "submit",
        "--state", str(served.daemon.settings.state_dir),
        "--socket", str(served.daemon.settings.state_dir / "nowhere.sock"),
        env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    token = out.decode().strip()
    assert served.daemon.clients.lookup(token) is not None
    pin = fingerprint(served.cert.read_bytes())
    assert f"TALLY_TLS_FINGERPRINT={pin}".encode() in err
    assert f"TALLY_TOKEN={token}".encode() in err


# ---------------------------------------------------------------- federation over TLS


async def test_two_daemons_federate_over_tls_and_verification_is_ok(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert served.cert is not None
    first = served.daemon
    monkeypatch.setenv(TOKEN_ENV, first.clients.add("second", "submit"))
    key = first.ledger.vkey
    assert key is not None
    pin = fingerprint(served.cert.read_bytes())
    text = second_roster(f"{served.origin}/v1", key).replace(
        "tally = true\n", f'tally = true\ntls_fingerprint = "{pin}"\n'
    )
    (tmp_path / "b").mkdir()
    second = Daemon(settings_for(tmp_path / "b", text))
    await second.start()
    try:
        await run_through(second)
        await first.ledger.checkpoint()
        report = await verify_remote(second.ledger, second.roster)
        assert (report.ok, report.failed) == (1, 0), report
        # the same roster pinning another certificate proves nothing
        wrong = load_roster_text(text.replace(pin, "sha256:" + "0" * 64))
        report = await verify_remote(second.ledger, wrong)
        assert (report.ok, report.failed) == (0, 1), report
        reason = report.results[0].reason or ""
        assert "is not the pinned one" in reason, reason
        assert pin in reason
    finally:
        await second.stop()


def test_a_tls_pin_needs_an_https_member() -> None:
    pin = "sha256:" + "a" * 64
    Member.model_validate({"name": "m", "url": "https://h:1/v1", "tls_fingerprint": pin})
    Member.model_validate({"name": "m", "url": "https://h:1/v1", "tls_ca": "/etc/ca.pem"})
    for fields, problem in (
        ({"url": "http://h:1/v1", "tls_fingerprint": pin}, "https"),
        ({"url": "https://h:1/v1", "tls_fingerprint": "sha256:ABC"}, "pattern"),
        ({"url": "https://h:1/v1", "tls_ca": "relative.pem"}, "absolute"),
        ({"url": "https://h:1/v1", "tls_fingerprint": pin, "tls_ca": "/a.pem"}, "one of"),
    ):
        with pytest.raises(ValidationError, match=problem):
            Member.model_validate({"name": "m", **fields})


async def test_the_tally_client_pins_the_certificate(served: Served) -> None:
    """What `TALLY_URL` + `TALLY_TOKEN` + `TALLY_TLS_FINGERPRINT` give the CLI and MCP adapter."""
    from surfaces.client import DaemonClient, DaemonError, Endpoint

    assert served.cert is not None
    token = served.daemon.clients.add("cli", "read")
    pin = fingerprint(served.cert.read_bytes())
    endpoint = Endpoint(url=served.origin, token=token, tls_fingerprint=pin)
    async with DaemonClient(endpoint) as client:
        health = await client.call("health", {})
    assert health["listener"]["tls_fingerprint"] == pin
    assert health["listener"]["cert_path"] is None  # the state dir's place is the admin's
    async with DaemonClient(Endpoint(url=served.origin, token=token, tls_ca=served.cert)) as c:
        assert (await c.call("health", {}))["status"] == "ok"
    wrong = Endpoint(url=served.origin, token=token, tls_fingerprint="sha256:" + "0" * 64)
    async with DaemonClient(wrong) as client:
        with pytest.raises(DaemonError, match="not TALLY_TLS_FINGERPRINT") as refused:
            await client.call("health", {})
    assert pin in refused.value.message


async def test_the_console_logs_in_from_its_https_origin(served: Served) -> None:
    """The console's login URL names the TLS listener by its --host-name, and its login is
    accepted from that page's own origin (https://name:port) only."""
    assert served.cert is not None
    pin = _pin(served.cert)
    admin = served.daemon.clients.add("ops", "admin")
    host = f"{NAME}:{served.port}"
    async with aiohttp.ClientSession(headers={"Host": host}) as http:

        async def login(code: str, origin: str) -> int:
            headers = {"Origin": origin, "Sec-Fetch-Site": "same-origin"}
            url = f"{served.origin}/console/login"
            async with http.post(url, json={"code": code}, headers=headers, ssl=pin) as resp:
                return resp.status

        async def mint() -> str:
            url = f"{served.origin}/v1/console/code"
            auth = {"Authorization": f"Bearer {admin}"}
            async with http.post(url, json={}, headers=auth, ssl=pin) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
            assert body["url"].startswith(f"https://{host}/console/login#code=")
            return str(body["url"].partition("#code=")[2])

        assert await login(await mint(), f"http://{host}") == 403  # not the page's scheme
        assert await login(await mint(), f"https://evil.example:{served.port}") == 403
        assert await login(await mint(), f"https://{host}") == 200


@pytest.mark.parametrize(
    "body",
    ["AAAA", "MAA=", "MIIBAAAA", "SGVsbG8gd29ybGQ="],  # not DER, an empty SEQUENCE, cut, text
)
def test_a_pem_block_that_is_no_certificate_gets_no_fingerprint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str
) -> None:
    # Any base64 between the PEM lines once got a "fingerprint" a client would then pin.
    from daemon.tls import fingerprint
    from surfaces.cli import main

    pem = f"-----BEGIN CERTIFICATE-----\n{body}\n-----END CERTIFICATE-----\n"
    with pytest.raises(ValueError, match="not a DER certificate"):
        fingerprint(pem.encode())
    path = tmp_path / "cert.pem"
    path.write_text(pem)
    assert main(["cert", "--tls-cert", str(path), "--fingerprint"]) == 1
    assert "not a DER certificate" in capsys.readouterr().err
