"""Fixtures of the gateway tests: certificates made on the spot (`certs`): a CA, a server
certificate for 127.0.0.1 and localhost, client certificates, and a second CA that the
server does not trust; with the `cryptography` package when it is installed, else with
`openssl` on PATH (skipped when neither is there, failed under CI)."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pair:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


def _need_a_tool() -> str:
    try:
        import cryptography  # noqa: F401
        return "cryptography"
    except ImportError:
        pass
    if shutil.which("openssl"):
        return "openssl"
    if os.environ.get("CI") == "true":
        pytest.fail("neither the cryptography package nor openssl is installed, and CI=true")
    pytest.skip("neither the cryptography package nor openssl is installed")


def _with_cryptography(folder: Path, name: str, ca: Pair | None, *, server: bool, client: bool = False) -> Pair:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    if ca is None:
        issuer, signer = subject, key
    else:
        ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
        issuer = ca_cert.subject
        signer = serialization.load_pem_private_key(ca.key.read_bytes(), None)  # type: ignore[assignment]
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca is None, path_length=None), critical=True))
    if ca is not None:
        usages = [ExtendedKeyUsageOID.SERVER_AUTH] if server else []
        usages += [ExtendedKeyUsageOID.CLIENT_AUTH] if client or not server else []
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(signer, hashes.SHA256())  # type: ignore[arg-type]
    pair = Pair(folder / f"{name}.pem", folder / f"{name}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return pair


def _with_openssl(folder: Path, name: str, ca: Pair | None, *, server: bool, client: bool = False) -> Pair:
    pair = Pair(folder / f"{name}.pem", folder / f"{name}.key")
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(pair.key)]
    if ca is None:
        subprocess.run(["openssl", "req", "-x509", *key, "-out", str(pair.cert), "-days", "1", "-subj", f"/CN={name}"],
                       check=True, capture_output=True)
        return pair
    csr = folder / f"{name}.csr"
    subprocess.run(["openssl", "req", *key, "-out", str(csr), "-subj", f"/CN={name}"], check=True, capture_output=True)
    ext = folder / f"{name}.ext"
    both = ",clientAuth" if client else ""
    ext.write_text(f"subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth{both}\n" if server
                   else "extendedKeyUsage=clientAuth\n")
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
                    "-CAcreateserial", "-out", str(pair.cert), "-days", "1", "-extfile", str(ext)],
                   check=True, capture_output=True)
    return pair


def make(folder: Path, name: str, ca: Pair | None = None, *, server: bool = False, client: bool = False) -> Pair:
    """A CA (`ca` None) or a certificate it signs: for 127.0.0.1 and localhost when `server`, and for client auth
    too with `server` and `client` (a fleet node under mutual TLS shows its own certificate to the others)."""
    folder.mkdir(parents=True, exist_ok=True)
    tool = _need_a_tool()
    return (_with_cryptography if tool == "cryptography" else _with_openssl)(folder, name, ca, server=server,
                                                                              client=client)


@dataclass(frozen=True)
class Certs:
    """Every certificate the TLS tests use."""

    ca: Pair
    server: Pair
    client: Pair
    #: A CA the server does not trust, and a client certificate it signed.
    other_ca: Pair
    other_client: Pair


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """Certificates for the TLS tests, made once per session."""
    folder = tmp_path_factory.mktemp("certs")
    ca = make(folder, "ca")
    other = make(folder, "other-ca")
    return Certs(ca=ca, server=make(folder, "server", ca, server=True), client=make(folder, "client", ca),
                 other_ca=other, other_client=make(folder, "other-client", other))
