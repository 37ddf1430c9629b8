"""TLS for a test's own Redis: a CA, a server certificate for 127.0.0.1 and a client
certificate, made with `openssl` in the test's directory."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

from tests.support.processes import require


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_options(self, tls_port: int) -> list[str]:
        """redis-server's options to listen with TLS only, on `tls_port`, and ask clients for
        a certificate signed by the CA."""
        return [
            "--port", "0", "--tls-port", str(tls_port), "--tls-cert-file", str(self.server_cert),
            "--tls-key-file", str(self.server_key), "--tls-ca-cert-file", str(self.ca),
            "--tls-auth-clients", "yes",
        ]  # fmt: skip

    def url(self, address: str, credentials: str = "") -> str:
        """A `rediss://` URL of `address` with the client's CA, certificate and key."""
        query = urlencode(
            {"ssl_ca_certs": self.ca, "ssl_certfile": self.client_cert, "ssl_keyfile": self.client_key}
        )
        userinfo = f"{credentials}@" if credentials else ""
        return f"rediss://{userinfo}{address}/0?{query}"


def _openssl(*arguments: str) -> None:
    subprocess.run(["openssl", *arguments], check=True, capture_output=True)


def make_certificates(directory: Path) -> Certificates:
    require("openssl", None if shutil.which("openssl") else "no openssl on PATH to make certificates with")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=rlship test CA",
             "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    made = {}
    for name, names in (("server", "IP:127.0.0.1,DNS:localhost"), ("client", "DNS:rlship-client")):
        key, request, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.pem"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=rlship test {name}",
                 "-keyout", str(key), "-out", str(request))  # fmt: skip
        extensions = directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName={names}\n")
        _openssl("x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key),
                 "-CAcreateserial", "-days", "2", "-extfile", str(extensions), "-out", str(cert))  # fmt: skip
        made[name] = (cert, key)
    return Certificates(ca, *made["server"], *made["client"])
