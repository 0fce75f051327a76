"""TLS: the daemon's TCP listener (the operator's certificate or a self-signed one made in the
state dir), the bind rule for addresses beyond loopback, and how the daemon's own calls to
another tally daemon pin that daemon's certificate.

Everything here is Python's `ssl` module and the `cryptography` package: the certificate is
made by `cryptography`, the handshakes are OpenSSL's (TLS 1.2 and later only), and a pinned
fingerprint is checked by aiohttp's `Fingerprint` (the SHA-256 of the certificate's DER bytes,
the value `tally cert` prints and `openssl x509 -fingerprint -sha256` shows).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import re
import ssl
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from pydantic import BaseModel

from daemon import layout
from daemon.errors import TallyError
from daemon.files import PRIVATE, PUBLIC, write_atomic

log = logging.getLogger("tally.tls")

FINGERPRINT = re.compile(r"^sha256:[0-9a-f]{64}$")
"""How a certificate is named for pinning: `sha256:` and 64 lowercase hex digits."""
CERT_DAYS = 3650  # a self-signed certificate is trusted by its pin, not by its dates
HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$"
)


class Listener(BaseModel):
    """What the TCP listener is, as `health` shows it and `tally client add` prints it."""

    url: str
    tls: bool
    tls_fingerprint: str | None = None
    cert_path: str | None = None
    insecure_http: bool = False
    host_names: list[str] = []


# ---------------------------------------------------------------- binding


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and `localhost` are this machine; any other name or address is not
    (a name is not resolved: what it resolves to can change after the check)."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    # a peer of a dual-stack `::` listener comes as ::ffff:a.b.c.d (3.11 calls that not loopback)
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def bind_refusal(host: str, tls: bool, insecure_http: bool) -> str | None:
    """Why `--tcp host:port` may not be served (None: it may). Beyond loopback, tokens and
    prompts would cross the network in clear text: TLS, or an explicit `--insecure-http`."""
    if is_loopback(host) or tls or insecure_http:
        return None
    return (
        f"--tcp {host} is not a loopback address: serve it with --tls (a self-signed "
        "certificate is made if you give no --tls-cert), or accept clear text with "
        "--insecure-http (witnessed in the ledger and shown in `health`)"
    )


def check_host_name(name: str) -> str:
    """A `--host-name`: a DNS name or an IP address, lowercased; ValueError otherwise."""
    value = name.strip().lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        pass
    if not HOST_NAME.match(value):
        raise ValueError(f"--host-name {name!r} is not a DNS name or an IP address")
    return value


# ---------------------------------------------------------------- the listener's certificate


def fingerprint(cert_pem: bytes) -> str:
    """`sha256:<hex>` of the (first) certificate's DER bytes: in a chain file (leaf, then its
    issuers), the leaf's, the one the server presents and clients pin. ValueError if none."""
    text = cert_pem.decode("ascii", "replace")
    end = "-----END CERTIFICATE-----"
    first, found, _ = text.partition(end)  # `PEM_cert_to_DER_cert` reads one block only
    begin = first.find("-----BEGIN CERTIFICATE-----")
    if not found or begin < 0:
        raise ValueError("no PEM certificate")
    der = ssl.PEM_cert_to_DER_cert(first[begin:].strip() + "\n" + end + "\n")
    if not _one_sequence(der):  # base64 of anything is a PEM block: its pin would be garbage
        raise ValueError("the PEM block is not a DER certificate (one ASN.1 SEQUENCE)")
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _one_sequence(der: bytes) -> bool:
    """Whether `der` is exactly one DER SEQUENCE that opens with another (an X.509
    certificate's outer shape), read without the X.509 library (it is not loaded before the
    daemon listens)."""
    if len(der) < 2 or der[0] != 0x30:
        return False
    size, at = der[1], 2
    if size & 0x80:
        count = size & 0x7F
        if not 1 <= count <= 4 or len(der) < 2 + count:
            return False
        size, at = int.from_bytes(der[2 : 2 + count], "big"), 2 + count
    return at + size == len(der) and size > 0 and der[at] == 0x30  # tbsCertificate first


def tls_dir(state_dir: Path) -> Path:
    return state_dir / layout.TLS


def self_signed_paths(state_dir: Path) -> tuple[Path, Path]:
    base = tls_dir(state_dir)
    return base / layout.TLS_CERT, base / layout.TLS_KEY


def _names_of(cert_pem: bytes) -> set[str]:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    names = {str(n).lower() for n in san.get_values_for_type(x509.DNSName)}
    return names | {str(a) for a in san.get_values_for_type(x509.IPAddress)}


def _pair_loads(cert_path: Path, key_path: Path) -> bool:
    """Whether the key belongs to the certificate (a crash while making them can split them)."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_path, key_path)
    except (ssl.SSLError, OSError):
        log.warning("the self-signed certificate and its key do not match: making a new pair")
        return False
    return True


def _wanted(names: Sequence[str]) -> list[str]:
    """The SANs: the bind address (unless it is the wildcard) and the listed names."""
    out: list[str] = []
    for name in names:
        value = name.strip("[]").lower()
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            pass
        else:
            if address.is_unspecified:
                continue
            value = str(address)
        if value not in out:
            out.append(value)
    return out or ["localhost"]


def ensure_self_signed(state_dir: Path, names: Sequence[str]) -> tuple[Path, Path]:
    """The state dir's self-signed certificate, made on first start (ECDSA P-256, SANs for
    `names`; the key file 0600). It is kept across restarts, so a pinned fingerprint stays
    valid; it is made again only when a name it must cover is missing from it (the log says
    so: clients then pin the new fingerprint)."""
    cert_path, key_path = self_signed_paths(state_dir)
    wanted = _wanted(names)
    if cert_path.exists() and key_path.exists():
        try:
            have = _names_of(cert_path.read_bytes())
        except ValueError as exc:
            raise TallyError(f"{cert_path}: not a PEM certificate ({exc}); remove it") from None
        if set(wanted) <= have and _pair_loads(cert_path, key_path):
            return cert_path, key_path
        log.warning(
            "the self-signed certificate lacks %s: making a new one (clients must pin the new "
            "fingerprint: `tally cert`)",
            ", ".join(sorted(set(wanted) - have)),
        )
    _write_self_signed(cert_path, key_path, wanted)
    return cert_path, key_path


def _write_self_signed(cert_path: Path, key_path: Path, names: list[str]) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tally {names[0]}"[:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        # A CA of itself only: clients may trust it as the CA (`--cacert`, `cafile=`).
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Two files, two renames: a crash between them pairs the new key with the old (or no)
    # certificate, which `ensure_self_signed` finds does not load and makes again.
    write_atomic(key_path, key_bytes, mode=PRIVATE)  # never readable by others
    write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=PUBLIC)


def server_context(cert_path: Path, key_path: Path) -> ssl.SSLContext:
    """The listener's context: TLS 1.2+, the certificate chain and its key."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path)
    except FileNotFoundError as exc:
        raise TallyError(f"TLS: {exc.filename}: no such file") from None
    except (ssl.SSLError, OSError) as exc:
        raise TallyError(
            f"TLS: cannot load the certificate {cert_path} with the key {key_path}: {exc}"
        ) from None
    return context


# ---------------------------------------------------------------- calls to another daemon


def client_ssl(
    tls_fingerprint: str | None, tls_ca: Path | str | None
) -> ssl.SSLContext | aiohttp.Fingerprint | bool:
    """How an https member is checked: exactly the pinned certificate (self-signed is fine),
    or against the given CA bundle (the name checked), else the system's CAs (`True`)."""
    if tls_fingerprint is not None:
        return aiohttp.Fingerprint(bytes.fromhex(tls_fingerprint.removeprefix("sha256:")))
    if tls_ca is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, checks the name
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_verify_locations(cafile=str(tls_ca))
        except (OSError, ssl.SSLError) as exc:
            # Fail closed: a context that trusts nothing refuses every handshake.
            log.error("tls_ca %s cannot be read (%s): calls to that member will fail", tls_ca, exc)
        return context
    return True
