"""Test-time PKI (the `cryptography` package): a CA, a server certificate for 127.0.0.1/localhost, a client
certificate, and a second, unrelated CA for negative cases."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class PKI:
    """Paths of the generated PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path
    #: Signed by ``ca`` for a name no server.readers entry has (mTLS: known to the CA, not allowed to read).
    stranger_cert: Path
    stranger_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(cn: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, server: bool
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(
            [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(directory: Path) -> PKI:
    """Write a fresh CA, server and client certificates (and an unrelated CA and client) under ``directory``."""
    ca, ca_key = _ca("hps-test-ca")
    server, server_key = _leaf("hps-server", ca, ca_key, server=True)
    client, client_key = _leaf("hps-client", ca, ca_key, server=False)
    other, other_key = _ca("other-ca")
    intruder, intruder_key = _leaf("intruder", other, other_key, server=False)
    stranger, stranger_key = _leaf("stranger", ca, ca_key, server=False)
    d = directory
    return PKI(
        ca=_write_cert(ca, d / "ca.pem"),
        server_cert=_write_cert(server, d / "server.pem"),
        server_key=_write_key(server_key, d / "server.key"),
        client_cert=_write_cert(client, d / "client.pem"),
        client_key=_write_key(client_key, d / "client.key"),
        other_ca=_write_cert(other, d / "other-ca.pem"),
        other_client_cert=_write_cert(intruder, d / "intruder.pem"),
        other_client_key=_write_key(intruder_key, d / "intruder.key"),
        stranger_cert=_write_cert(stranger, d / "stranger.pem"),
        stranger_key=_write_key(stranger_key, d / "stranger.key"),
    )
