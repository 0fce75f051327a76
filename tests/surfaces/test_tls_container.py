"""The README's Docker recipe, without Docker: a separate process standing for the container
reaches the daemon bound on a non-`localhost` loopback address (127.0.0.2, as the bridge
address would be) with TLS, configured only as the recipe configures the container:
`OPENAI_BASE_URL`, `OPENAI_API_KEY` (a `submit` client's token) and `SSL_CERT_FILE` (the
daemon's self-signed certificate). The openai SDK works; what `submit` does not allow is
refused; without the certificate the connection is refused."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.runs.model_server import roster_toml
from tests.slots.fake_server import FakeServer
from tests.surfaces.test_tls import ROOT, Served, start_served

CONTAINER = """
import json, httpx, openai
client = openai.OpenAI(max_retries=0, timeout=30)
models = [m.id for m in client.models.list().data]
reply = client.chat.completions.create(
    model="tier:cheap", messages=[{"role": "user", "content": "hello"}], max_tokens=16
)
admin = httpx.post(  # trust_env: SSL_CERT_FILE, as the SDK's own client
    client.base_url.join("tools/client_add"), json={"name": "x", "scope": "admin"},
    headers={"Authorization": "Bearer " + client.api_key}, timeout=30,
)
print(json.dumps({"models": models, "content": reply.choices[0].message.content,
                  "admin": admin.status_code}))
"""


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    model = FakeServer(slots=2, n_ctx=4096)
    await model.start()
    one = await start_served(tmp_path / "a", roster_toml(model.url))
    try:
        yield one
    finally:
        await one.close()
        await model.stop()


async def _container(env: dict[str, str]) -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TALLY_", "OPENAI_", "SSL_"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CONTAINER, env=base | env, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return int(proc.returncode or 0), out.decode(), err.decode()


async def test_a_container_reaches_the_daemon_as_the_readme_says(served: Served) -> None:
    import json

    assert served.cert is not None
    token = served.daemon.clients.add("my-container", "submit")
    env = {"OPENAI_BASE_URL": f"{served.origin}/v1", "OPENAI_API_KEY": token}
    code, out, err = await _container({**env, "SSL_CERT_FILE": str(served.cert)})
    assert code == 0, err
    said = json.loads(out)
    assert "tier:cheap" in said["models"]
    assert said["content"]
    assert said["admin"] == 403, said  # a `submit` client adds no clients
    # Without the certificate pinned, the self-signed daemon is not trusted.
    code, out, err = await _container(env)
    assert code != 0
    assert "CERTIFICATE_VERIFY_FAILED" in err or "APIConnectionError" in err, err


async def test_client_add_against_the_running_daemon_prints_url_token_and_pin(
    tmp_path: Path,
) -> None:
    """`tally client add` through the daemon's socket: the URL it serves (from `health`), the
    token and the certificate's pin: what the container's recipe needs, and they work."""
    from daemon.service import Daemon
    from daemon.slots.process import free_port
    from daemon.tls import ensure_self_signed, fingerprint
    from surfaces.http import HttpOptions, Listen, serve
    from tests.runs.model_server import settings_for
    from tests.surfaces.test_tls import HOST, NAME

    model = FakeServer(slots=2, n_ctx=4096)
    await model.start()
    settings = settings_for(tmp_path, roster_toml(model.url))
    daemon = Daemon(settings)
    cert, key = ensure_self_signed(settings.state_dir, [HOST, NAME])
    port = free_port()
    sock = settings.runtime_dir / "tally.sock"
    stop = asyncio.Event()
    listen = Listen(sock, f"{HOST}:{port}", tls=(cert, key))
    task = asyncio.create_task(serve(daemon, listen, HttpOptions(host_names=(NAME,)), stop=stop))
    try:
        for _ in range(400):
            if daemon.listener is not None and sock.exists():
                break
            assert not task.done(), task.exception()
            await asyncio.sleep(0.025)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "surfaces", "client", "add", "box", "--scope", "submit",
            "--socket", str(sock), env=env, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err
        token = out.decode().strip()
        said = err.decode()
        assert f"TALLY_URL=https://{NAME}:{port}" in said, said  # the name clients use
        assert f"TALLY_TOKEN={token}" in said, said
        assert f"TALLY_TLS_FINGERPRINT={fingerprint(cert.read_bytes())}" in said, said
        code, _, err_text = await _container(  # no DNS for NAME here: its address
            {
                "OPENAI_BASE_URL": f"https://{HOST}:{port}/v1",
                "OPENAI_API_KEY": token,
                "SSL_CERT_FILE": str(cert),
            }
        )
        assert code == 0, err_text
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await model.stop()


async def _shell(script: str, env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TALLY_", "OPENAI_", "SSL_"))}
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, env=base | env, cwd=cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return int(proc.returncode or 0), out.decode(), err.decode()


@pytest.mark.skipif(not shutil.which("curl"), reason="curl is missing")
async def test_the_readmes_curl_and_llm_recipes_with_the_pinned_certificate(
    served: Served, tmp_path: Path
) -> None:
    """README "Serve a team": curl with `--cacert` and with `--pinnedpubkey`, and `llm` with
    `extra-openai-models.yaml` and `SSL_CERT_FILE`, as written there, against the daemon's
    self-signed certificate; a wrong pin is refused (the SDK without the certificate is
    refused in the container test above)."""
    assert served.cert is not None
    token = served.daemon.clients.add("teammate", "submit")
    shutil.copy(served.cert, tmp_path / "tally.pem")
    url = served.origin
    env = {"TOKEN": token, "URL": url}
    code, out, err = await _shell(
        'curl -sS --fail --cacert tally.pem "$URL/v1/models" -H "Authorization: Bearer $TOKEN"',
        env,
        tmp_path,
    )
    assert code == 0, err
    assert "tier:cheap" in out
    pinned = (
        'curl -sS --fail -k --pinnedpubkey "sha256//$(openssl x509 -in tally.pem -pubkey -noout |'
        ' openssl pkey -pubin -outform der | openssl dgst -sha256 -binary | base64)"'
        ' "$URL/v1/models" -H "Authorization: Bearer $TOKEN"'
    )
    code, out, err = await _shell(pinned, env, tmp_path)
    assert code == 0, err
    assert "tier:cheap" in out
    wrong = 'curl -sS -k --pinnedpubkey "sha256//AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=" '
    code, out, err = await _shell(wrong + '"$URL/v1/models"', env, tmp_path)
    assert code != 0, out
    assert "pinned" in err.lower(), err
    # llm: the model declared in its config dir, the token as its key, the certificate trusted.
    config = tmp_path / "llm"
    config.mkdir()
    (config / "extra-openai-models.yaml").write_text(
        "- model_id: tally-cheap\n  model_name: tier:cheap\n"
        f"  api_base: {url}/v1\n  api_key_name: tally\n"
    )
    llm = {"LLM_USER_PATH": str(config), "LLM_LOAD_PLUGINS": ""}
    python = sys.executable
    keys = f'"{python}" -m llm keys set tally --value "$TOKEN"'
    code, _, err = await _shell(keys, env | llm, ROOT)
    assert code == 0, err
    ask = f'"{python}" -m llm -m tally-cheap --no-log "write the changelog"'
    code, out, err = await _shell(ask, env | llm | {"SSL_CERT_FILE": str(served.cert)}, ROOT)
    assert code == 0, err
    assert out.strip(), err


def _ca_and_leaf(where: Path, host: str) -> tuple[Path, Path, Path]:
    """A CA, and a certificate for `host` it signed (the operator's own PKI): paths of the CA,
    the chain (leaf then CA) and the leaf's key."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "team CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                       critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    (where / "ca.pem").write_bytes(ca.public_bytes(pem))
    (where / "chain.pem").write_bytes(leaf.public_bytes(pem) + ca.public_bytes(pem))
    (where / "key.pem").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return where / "ca.pem", where / "chain.pem", where / "key.pem"


async def test_the_operators_certificate_chain_is_served(tmp_path: Path) -> None:
    """`--tls --tls-cert --tls-key`: the operator's chain, verified by a client that trusts
    only the operator's CA (`SSL_CERT_FILE`); no self-signed certificate is made."""
    from daemon.service import Daemon
    from daemon.slots.process import free_port
    from surfaces.cli.serve import tls_paths
    from surfaces.http import HttpOptions, Listen, serve
    from tests.runs.model_server import settings_for
    from tests.surfaces.test_tls import HOST

    ca, chain, key = await asyncio.to_thread(_ca_and_leaf, tmp_path, HOST)
    model = FakeServer(slots=2, n_ctx=4096)
    await model.start()
    port = free_port()
    settings = settings_for(
        tmp_path, roster_toml(model.url), tcp=f"{HOST}:{port}", tls=True, tls_cert=chain,
        tls_key=key,
    )  # fmt: skip
    pair = tls_paths(settings)
    assert pair == (chain, key)
    daemon = Daemon(settings)
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve(daemon, Listen(None, settings.tcp, tls=pair), HttpOptions(), stop=stop)
    )
    try:
        for _ in range(400):
            if daemon.listener is not None:
                break
            assert not task.done(), task.exception()
            await asyncio.sleep(0.025)
        assert not (settings.state_dir / "tls").exists()  # nothing self-signed was made
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes

        leaf = x509.load_pem_x509_certificate(chain.read_bytes())  # the chain's first: the leaf
        assert daemon.listener is not None
        pin = "sha256:" + leaf.fingerprint(hashes.SHA256()).hex()
        assert daemon.listener.tls_fingerprint == pin
        token = daemon.clients.add("svc", "submit")
        env = {"OPENAI_BASE_URL": f"https://{HOST}:{port}/v1", "OPENAI_API_KEY": token}
        code, out, err = await _container({**env, "SSL_CERT_FILE": str(ca)})
        assert code == 0, err
        assert '"admin": 403' in out, out
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await model.stop()
