"""Test certificates: a CA, a server certificate for 127.0.0.1/localhost, client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, issuer_key, issuer_name, *, ca=False, server=False):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name or _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _write(folder: Path, stem: str, key, cert) -> tuple[Path, Path]:
    key_path, cert_path = folder / f"{stem}.key", folder / f"{stem}.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def make_pki(folder: Path) -> dict[str, Path]:
    """ca, server cert/key, client cert/key (signed by ca), rogue cert/key (another CA)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _issue("specd test CA", None, None, ca=True)
    other_key, other_cert = _issue("another CA", None, None, ca=True)
    out = {"ca": _write(folder, "ca", ca_key, ca_cert)[0]}
    out["server_cert"], out["server_key"] = _write(
        folder, "server", *_issue("server", ca_key, ca_cert.subject, server=True)
    )
    out["client_cert"], out["client_key"] = _write(
        folder, "client", *_issue("client", ca_key, ca_cert.subject)
    )
    out["rogue_cert"], out["rogue_key"] = _write(
        folder, "rogue", *_issue("rogue", other_key, other_cert.subject)
    )
    return out
