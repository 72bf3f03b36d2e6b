"""Certificates and a TLS-only Redis Cluster with ACL users, started by the tests that need them.

The certificates come from a throwaway CA made here with `cryptography` (server certificates for
127.0.0.1, a client certificate for mutual TLS). The cluster: three `redis-server` masters with
`--port 0 --tls-port`, TLS on the cluster bus, client certificates required, the `default` user
off, a `sluice` user allowed everything on `sluice*`/test-prefixed keys, and a `readonly` user that
may not run scripts.
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    server_pem: Path  # certificate and key in one file (brokers that take one file)
    client_key_encrypted: Path  # the client key under KEY_PASSWORD


KEY_PASSWORD = "client-key-pw-4b7e"


def make_pki(folder: Path) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key_pem(key):
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("sluice test CA")).issuer_name(name("sluice test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn, server: bool):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1)))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST)),
                                                             x509.DNSName("localhost")]), critical=False)
        return b.sign(ca_key, hashes.SHA256()), key

    out = {}
    for label, cert, key in [("server", *leaf("127.0.0.1", True)), ("client", *leaf("sluice-worker", False))]:
        (folder / f"{label}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{label}.key").write_bytes(key_pem(key))
        out[label] = (folder / f"{label}.crt", folder / f"{label}.key")
    (folder / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pem = folder / "server.pem"
    pem.write_bytes(out["server"][0].read_bytes() + out["server"][1].read_bytes())
    client_key = serialization.load_pem_private_key(out["client"][1].read_bytes(), None)
    encrypted = folder / "client-encrypted.key"
    encrypted.write_bytes(client_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(KEY_PASSWORD.encode())))
    return Pki(folder / "ca.crt", *out["server"], *out["client"], pem, encrypted)


class TlsRedisCluster:
    PASSWORD = "acl-pw-7f3c9e21"
    READONLY_PASSWORD = "ro-pw-51d8aa02"

    def __init__(self, folder: Path, pki: Pki, ports=(17101, 17102, 17103)):
        self.folder, self.pki, self.ports = folder, pki, ports
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"rediss://{HOST}:{self.ports[0]}"

    def _tls_args(self) -> list[str]:
        return ["--cert", str(self.pki.client_cert), "--key", str(self.pki.client_key),
                "--cacert", str(self.pki.ca)]

    def start(self) -> "TlsRedisCluster":
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        acl = self.folder / "users.acl"
        acl.write_text("user default off\n"
                       f"user sluice on >{self.PASSWORD} ~* &* +@all\n"
                       f"user readonly on >{self.READONLY_PASSWORD} ~* &* +@all -@scripting\n")
        for port in self.ports:
            node = self.folder / f"tls-{port}"
            shutil.rmtree(node, ignore_errors=True)
            node.mkdir(parents=True)
            argv = [server, "--port", "0", "--tls-port", str(port), "--bind", HOST,
                    "--tls-cert-file", str(self.pki.server_cert), "--tls-key-file", str(self.pki.server_key),
                    "--tls-ca-cert-file", str(self.pki.ca), "--tls-auth-clients", "yes", "--tls-cluster", "yes",
                    "--tls-replication", "yes", "--cluster-enabled", "yes",
                    "--cluster-config-file", str(node / "nodes.conf"), "--dir", str(node), "--save", "",
                    "--appendonly", "no", "--aclfile", str(acl)]
            log = (node / "redis.log").open("ab")
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True))
        for port in self.ports:
            self._wait(cli, port)
        res = subprocess.run([cli, "--tls", *self._tls_args(), "--user", "sluice", "--pass", self.PASSWORD,
                              "--cluster", "create", *[f"{HOST}:{p}" for p in self.ports], "--cluster-yes"],
                             capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            self.stop()
            raise RuntimeError(f"TLS cluster create failed: {res.stdout[-400:]} {res.stderr[-400:]}")
        end = time.monotonic() + 30
        while "cluster_state:ok" not in self._cli(cli, self.ports[0], "cluster", "info"):
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError("TLS cluster never reached cluster_state:ok")
            time.sleep(0.2)
        return self

    def _cli(self, cli: str, port: int, *args: str) -> str:
        return subprocess.run([cli, "--tls", *self._tls_args(), "-h", HOST, "-p", str(port), "--user", "sluice",
                               "--pass", self.PASSWORD, "--no-auth-warning", *args],
                              capture_output=True, text=True, timeout=5).stdout

    def _wait(self, cli: str, port: int) -> None:
        end = time.monotonic() + 20
        while "PONG" not in self._cli(cli, port, "ping"):
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"TLS redis on {port} did not answer")
            time.sleep(0.1)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


class MutualTlsProxy:
    """A TLS endpoint in front of a plaintext Kafka broker: it requires a client certificate signed by
    the test CA, and pipes bytes to the broker. The broker advertises the proxy's address, so every
    connection a client makes (bootstrap, group coordinator, partition leaders) goes through it.
    `verified` lists the certificate subject of every connection it accepted (a handshake without a
    valid certificate fails before a connection exists)."""

    def __init__(self, pki: Pki, listen_port: int, broker_port: int):
        self.pki, self.listen_port, self.broker_port = pki, listen_port, broker_port
        self.verified: list[str] = []
        self._server = None

    async def start(self) -> "MutualTlsProxy":
        import asyncio
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.pki.ca))
        ctx.load_cert_chain(str(self.pki.server_cert), str(self.pki.server_key))
        ctx.verify_mode = ssl.CERT_REQUIRED
        self._server = await asyncio.start_server(self._serve, HOST, self.listen_port, ssl=ctx,
                                                  ssl_handshake_timeout=5)
        return self

    async def _serve(self, reader, writer) -> None:
        import asyncio

        from tests.integration.kafka_proxy import pipe

        cert = writer.get_extra_info("peercert")
        self.verified.append(dict(x[0] for x in cert["subject"])["commonName"])
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.broker_port)
        except OSError:
            writer.close()
            return

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
