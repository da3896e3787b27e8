"""Stand-ins for a secured Kafka listener in the tests: a mutual-TLS terminator and a SASL front end.

Tansu 0.6.0, the embedded broker, speaks neither TLS nor usable SASL on its listener (docs/usage.md,
Security), so each proxy does its part of a secured broker's work and then forwards the connection, unchanged,
to its upstream. The broker advertises the outermost proxy, so every connection a client opens after
bootstrapping passes through the chain too. Each proxy records what it saw (certificates, authentications,
refusals), so a test can tell a secured connection from one that merely got through.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import os
import secrets
import shutil
import ssl
import struct
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

_SASL_HANDSHAKE, _SASL_AUTHENTICATE, _API_VERSIONS = 17, 36, 18
_UNSUPPORTED_SASL_MECHANISM, _SASL_AUTHENTICATION_FAILED = 33, 58
_SCRAM_HASHES: dict[str, Callable[..., Any]] = {
    "SCRAM-SHA-256": hashlib.sha256,
    "SCRAM-SHA-512": hashlib.sha512,
}
_SCRAM_ITERATIONS = 4096  # Kafka's minimum


class Refused(Exception):
    """The client side of a connection failed the proxy's check; the connection is closed."""


class ProxyServer:
    """A loopback TCP proxy on an event loop of its own thread, so it serves clients on any loop or thread.

    `secure` handles the client side of a connection before anything is forwarded; subclasses override it.
    `upstream` may be set after start(): the broker behind a proxy is started once the proxy's port is known.
    """

    def __init__(self) -> None:
        self.upstream: tuple[str, int] | None = None
        self.errors: list[str] = []  # unexpected failures inside the proxy: a test expects none
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=type(self).__name__, daemon=True)
        self._server: asyncio.Server | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the proxy is not running")
        return self._port

    def start(self) -> ProxyServer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop
        ).result(10)
        self._port = int(self._server.sockets[0].getsockname()[1])
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            assert self.upstream is not None, "the proxy has no upstream yet"
            await self.secure(reader, writer)
            up_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
            await self.forward(reader, writer, up_reader, upstream_writer)
        except (Refused, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the subclass recorded why; the client sees its connection closed
        except Exception as exc:  # a bug in the proxy: make the test fail, not hang
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            for stream in (writer, upstream_writer):
                if stream is not None:
                    stream.close()

    async def secure(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Check the client side of a new connection; raise Refused to close it."""

    async def forward(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        """Copy bytes both ways until either side closes."""
        await _pipe_both(reader, writer, up_reader, up_writer)


async def _pipe_both(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    tasks = [asyncio.create_task(_pipe(reader, up_writer)), asyncio.create_task(_pipe(up_reader, writer))]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        while chunk := await source.read(65536):
            sink.write(chunk)
            await sink.drain()


class TlsProxy(ProxyServer):
    """Terminates TLS with a server certificate and requires a client certificate signed by `client_ca`."""

    def __init__(self, certfile: Path, keyfile: Path, client_ca: Path) -> None:
        super().__init__()
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(client_ca))
        self._context.load_cert_chain(certfile, keyfile)
        self._context.verify_mode = ssl.CERT_REQUIRED
        self.client_subjects: list[str] = []  # common name of each verified client certificate
        self.refused: list[str] = []  # why each failed handshake failed

    async def secure(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A ConnectionError (a client hanging up mid-handshake as it stops) is no refusal: _serve drops it.
        try:
            await writer.start_tls(self._context)
        except ssl.SSLError as exc:
            self.refused.append(f"{type(exc).__name__}: {exc}")
            raise Refused from exc
        certificate = writer.get_extra_info("peercert")
        subject = dict(pair for rdn in certificate["subject"] for pair in rdn)
        self.client_subjects.append(subject["commonName"])


@dataclass(frozen=True)
class _ScramCredential:
    """What a server stores for a SCRAM user (RFC 5802 section 3): never the password itself."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    @classmethod
    def derive(cls, mechanism: str, password: str) -> _ScramCredential:
        digest = _SCRAM_HASHES[mechanism]
        salt = secrets.token_bytes(16)
        salted = hashlib.pbkdf2_hmac(digest().name, password.encode(), salt, _SCRAM_ITERATIONS)
        client_key = hmac.new(salted, b"Client Key", digest).digest()
        server_key = hmac.new(salted, b"Server Key", digest).digest()
        return cls(salt, _SCRAM_ITERATIONS, digest(client_key).digest(), server_key)


class SaslProxy(ProxyServer):
    """Kafka's SASL exchange (SaslHandshake v0-1, SaslAuthenticate v0-1) for PLAIN and SCRAM-SHA-256/512.

    ApiVersions is answered by the broker behind; any other request before a successful authentication closes
    the connection, as Kafka does. Once authenticated, the connection is forwarded unchanged.
    """

    MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")

    def __init__(self, users: dict[str, str]) -> None:
        super().__init__()
        self._plain = dict(users)
        self._scram = {
            (mechanism, user): _ScramCredential.derive(mechanism, password)
            for mechanism in _SCRAM_HASHES
            for user, password in users.items()
        }
        # (user, mechanism, client id) of each successful exchange: which client authenticated, and how
        self.authenticated: list[tuple[str, str, str]] = []
        self.failures: list[str] = []  # each refused exchange or request, without any secret

    async def forward(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        session = _SaslSession(self)
        while not session.done:
            frame = await _read_frame(reader)
            api_key, version, correlation_id = struct.unpack_from(">hhi", frame)
            if api_key == _API_VERSIONS:
                up_writer.write(struct.pack(">i", len(frame)) + frame)
                writer.write(await _read_whole_frame(up_reader))
            elif api_key in (_SASL_HANDSHAKE, _SASL_AUTHENTICATE) and version <= 1:
                session.client_id, body = _split_request_header(frame)
                reply = session.handshake(body) if api_key == _SASL_HANDSHAKE else session.step(body, version)
                writer.write(_response(correlation_id, reply))
            else:
                self.failures.append(f"api key {api_key} v{version} before authentication")
                raise Refused
            await writer.drain()
            if session.failed:
                raise Refused  # Kafka closes the connection after a failed authentication
        await _pipe_both(reader, writer, up_reader, up_writer)


class _SaslSession:
    """One connection's SASL state: the chosen mechanism, then one or two authentication steps."""

    def __init__(self, proxy: SaslProxy) -> None:
        self._proxy = proxy
        self.mechanism: str | None = None
        self.client_id = ""
        self.done = False
        self.failed = False
        self._scram: _ScramExchange | None = None

    def handshake(self, body: bytes) -> bytes:
        mechanism, _ = _read_string(body, 0)
        enabled = b"".join(_string(name) for name in SaslProxy.MECHANISMS)
        listing = struct.pack(">i", len(SaslProxy.MECHANISMS)) + enabled
        if mechanism not in SaslProxy.MECHANISMS:
            self._proxy.failures.append(f"mechanism {mechanism} is not enabled")
            return struct.pack(">h", _UNSUPPORTED_SASL_MECHANISM) + listing
        self.mechanism = mechanism
        return struct.pack(">h", 0) + listing

    def step(self, body: bytes, version: int) -> bytes:
        (size,) = struct.unpack_from(">i", body)
        token = body[4 : 4 + size]
        try:
            reply = self._step(token)
        except Refused as refusal:
            self.failed = True
            self._proxy.failures.append(str(refusal))
            return _authenticate_response(version, _SASL_AUTHENTICATION_FAILED, str(refusal), b"")
        return _authenticate_response(version, 0, None, reply)

    def _step(self, token: bytes) -> bytes:
        if self.mechanism is None:
            raise Refused("SaslAuthenticate before SaslHandshake")
        if self.mechanism == "PLAIN":
            return self._plain(token)
        if self._scram is None:
            self._scram = _ScramExchange(self.mechanism, self._proxy._scram)
            return self._scram.server_first(token)
        reply, user = self._scram.server_final(token)
        self._succeed(user)
        return reply

    def _plain(self, token: bytes) -> bytes:
        # RFC 4616: authzid NUL authcid NUL passwd
        parts = token.split(b"\0")
        if len(parts) != 3:
            raise Refused("Authentication failed: malformed PLAIN message")
        user, password = parts[1].decode(), parts[2].decode()
        expected = self._proxy._plain.get(user)
        if expected is None or not hmac.compare_digest(password.encode(), expected.encode()):
            raise Refused(f"Authentication failed: invalid username or password for {user} (PLAIN)")
        self._succeed(user)
        return b""

    def _succeed(self, user: str) -> None:
        assert self.mechanism is not None
        self._proxy.authenticated.append((user, self.mechanism, self.client_id))
        self.done = True


class _ScramExchange:
    """The server side of one SCRAM exchange (RFC 5802, RFC 7677), without channel binding."""

    def __init__(self, mechanism: str, credentials: dict[tuple[str, str], _ScramCredential]) -> None:
        self._mechanism = mechanism
        self._digest = _SCRAM_HASHES[mechanism]
        self._credentials = credentials
        self._user = ""
        self._credential: _ScramCredential | None = None
        self._client_first_bare = ""
        self._server_first = ""
        self._nonce = ""

    def server_first(self, token: bytes) -> bytes:
        message = token.decode()
        if not message.startswith("n,,"):
            raise Refused(f"Authentication failed: unsupported GS2 header in {self._mechanism}")
        self._client_first_bare = message[3:]
        fields = _scram_fields(self._client_first_bare)
        self._user = fields["n"].replace("=2C", ",").replace("=3D", "=")
        self._credential = self._credentials.get((self._mechanism, self._user))
        if self._credential is None:
            raise Refused(f"Authentication failed: unknown user {self._user} ({self._mechanism})")
        self._nonce = fields["r"] + base64.b64encode(secrets.token_bytes(18)).decode()
        salt = base64.b64encode(self._credential.salt).decode()
        self._server_first = f"r={self._nonce},s={salt},i={self._credential.iterations}"
        return self._server_first.encode()

    def server_final(self, token: bytes) -> tuple[bytes, str]:
        assert self._credential is not None
        message = token.decode()
        without_proof, _, proof_field = message.rpartition(",")
        fields = _scram_fields(message)
        if fields.get("c") != "biws" or fields.get("r") != self._nonce or not proof_field.startswith("p="):
            raise Refused(f"Authentication failed: malformed {self._mechanism} final message")
        auth_message = f"{self._client_first_bare},{self._server_first},{without_proof}".encode()
        client_signature = self._hmac(self._credential.stored_key, auth_message)
        proof = base64.b64decode(fields["p"])
        client_key = bytes(a ^ b for a, b in zip(proof, client_signature, strict=True))
        if not hmac.compare_digest(self._digest(client_key).digest(), self._credential.stored_key):
            raise Refused(f"Authentication failed: invalid credentials for {self._user} ({self._mechanism})")
        server_signature = self._hmac(self._credential.server_key, auth_message)
        return f"v={base64.b64encode(server_signature).decode()}".encode(), self._user

    def _hmac(self, key: bytes, message: bytes) -> bytes:
        return hmac.new(key, message, self._digest).digest()


def _scram_fields(message: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in message.split(",") if "=" in part)


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = struct.unpack(">i", await reader.readexactly(4))
    return await reader.readexactly(size)


async def _read_whole_frame(reader: asyncio.StreamReader) -> bytes:
    frame = await _read_frame(reader)
    return struct.pack(">i", len(frame)) + frame


def _split_request_header(frame: bytes) -> tuple[str, bytes]:
    """Client id and body of a request, header v1: api key, version, correlation id, nullable client id."""
    (size,) = struct.unpack_from(">h", frame, 8)
    return frame[10 : 10 + max(size, 0)].decode(), frame[10 + max(size, 0) :]


def _read_string(data: bytes, offset: int) -> tuple[str, int]:
    (size,) = struct.unpack_from(">h", data, offset)
    return data[offset + 2 : offset + 2 + size].decode(), offset + 2 + size


def _string(value: str | None) -> bytes:
    if value is None:
        return struct.pack(">h", -1)
    raw = value.encode()
    return struct.pack(">h", len(raw)) + raw


def _authenticate_response(version: int, error: int, message: str | None, token: bytes) -> bytes:
    body = struct.pack(">h", error) + _string(message) + struct.pack(">i", len(token)) + token
    return body + (struct.pack(">q", 0) if version >= 1 else b"")  # v1: session lifetime (0: none)


def _response(correlation_id: int, body: bytes) -> bytes:
    payload = struct.pack(">i", correlation_id) + body
    return struct.pack(">i", len(payload)) + payload


@dataclass(frozen=True)
class Pki:
    """Certificates made at test time: a CA, a broker certificate, a client certificate, and decoys."""

    ca: Path
    server_cert: Path
    server_key: Path
    wrong_host_cert: Path  # signed by `ca` but naming another host than 127.0.0.1
    wrong_host_key: Path
    client_cert: Path
    client_key: Path  # encrypted with client_key_password
    client_key_password: str
    other_ca: Path  # a CA nobody trusts

    def mtls(self, **changes: object) -> dict[str, object]:
        """Settings of a client with its certificate, trusting the test CA (`changes` override them)."""
        values: dict[str, object] = {
            "security_protocol": "SSL",
            "ssl_cafile": self.ca,
            "ssl_certfile": self.client_cert,
            "ssl_keyfile": self.client_key,
            "ssl_key_password": self.client_key_password,
        }
        return values | changes


_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
authorityKeyIdentifier = keyid
[wrong_host]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:broker.invalid
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
authorityKeyIdentifier = keyid
"""


def make_test_pki(directory: Path) -> Pki:
    """Write the certificates with the openssl command (EC P-256 keys: quick to make); needs openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("the openssl command is not installed")
    config = directory / "openssl.cnf"
    config.write_text(_OPENSSL_CONFIG)
    key_password = secrets.token_urlsafe(12)

    def run(*args: str) -> None:
        env = {**os.environ, "OPENSSL_CONF": str(config)}
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=directory, env=env, timeout=60)

    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-config", str(config), "-days", "2"]
    for ca in ("ca", "other-ca"):
        subject = f"/CN=score-worker test {ca}"
        run("req", "-x509", *new_key, "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-subj", subject,
            "-extensions", "ca")  # fmt: skip
    for name, section in (("server", "server"), ("wrong-host", "wrong_host"), ("client", "client")):
        protect = ["-passout", f"pass:{key_password}"] if name == "client" else ["-nodes"]
        subject = "/CN=score-worker client" if name == "client" else "/CN=broker"
        run("req", "-new", *new_key, *protect, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", subject)  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial",
            str(secrets.randbits(63)), "-days", "2", "-out", f"{name}.pem", "-extfile", str(config),
            "-extensions", section)  # fmt: skip
    return Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        wrong_host_cert=directory / "wrong-host.pem",
        wrong_host_key=directory / "wrong-host.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        client_key_password=key_password,
        other_ca=directory / "other-ca.pem",
    )
