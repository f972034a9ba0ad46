"""TLS for the edge link: the certificate the edge listener serves, given or generated.

Edge devices send hidden states (and, in prompt_only sessions, early-layer KV) and receive
the generated text: the router serves their WebSocket on a listener of its own, over TLS
(`edge.tls`, on by default), so that what crosses the network is ciphertext under keys from
an authenticated handshake (TLS 1.2 at least, ECDHE with AES-GCM or ChaCha20-Poly1305 from
OpenSSL), and a record altered on the way fails its tag and ends the connection.

A deployment either gives a certificate and key (`edge.tls_cert`, `edge.tls_key`, PEM: one
its devices trust through their CA), or gets a self-signed one generated at start (ECDSA
P-256, valid for the router's host, this machine's name, 127.0.0.1, ::1 and localhost) in a
private folder; devices pin that certificate (`EdgeClient(ca_file=...)`, `hetero-pd edge
generate --ca-file`), whose path the router logs.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EdgeCert:
    """The certificate and key files the edge listener serves (`generated`: by us, at start,
    in a private folder removed with it)."""

    cert: Path
    key: Path
    generated: bool = False

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(
                f"edge.tls_cert {self.cert} / edge.tls_key {self.key}: cannot load them ({e}); "
                "give a PEM certificate and its private key, or neither to have one generated"
            ) from e
        return ctx

    def remove(self) -> None:
        """Deletes a generated pair and its folder (a given pair is left alone)."""
        if self.generated:
            for path in (self.cert, self.key):
                path.unlink(missing_ok=True)
            self.cert.parent.rmdir()


def edge_cert(cert: str, key: str, host: str) -> EdgeCert:
    """The given pair (both or neither: a ValueError naming the one missing), else a
    self-signed one for `host` generated now."""
    if cert and key:
        return EdgeCert(Path(cert), Path(key))
    if cert or key:
        missing = "edge.tls_key" if cert else "edge.tls_cert"
        raise ValueError(f"{missing} is missing: give the certificate and its key, or neither")
    return generate(host)


def generate(host: str) -> EdgeCert:
    """A self-signed certificate and key for `host` (and this machine's loopback names) in
    a new folder only this user can read."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    for name in {host, socket.gethostname(), "127.0.0.1", "::1"} - {"", "0.0.0.0", "::"}:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(name.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(name))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hetero-pd edge")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = Path(tempfile.mkdtemp(prefix="hetero-pd-edge-tls-"))  # 0700
    cert_path, key_path = folder / "edge-cert.pem", folder / "edge-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return EdgeCert(cert_path, key_path, generated=True)
