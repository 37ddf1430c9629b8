"""CURVE on the ZMQ step transport (docs/transports.md, "On a shared network"): the ship
worker's two sockets are CURVE servers, and a ZAP authenticator in its process admits only
the run's rank keys, so a peer without one neither subscribes (receives no step) nor
announces READY; each rank connects as a CURVE client with its own key pair.

The key directory holds pyzmq's certificate files (`zmq.auth.load_certificate` reads them):
`server.key`/`server.key_secret` and `rank-{r}.key`/`rank-{r}.key_secret`. A host needs
only its side's files: the ship worker's host `server.key_secret` and every `rank-{r}.key`,
rank r's host `rank-{r}.key_secret` and `server.key`.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger("rlship.transport")

SERVER = "server"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


class MissingKey(Exception):
    """A key file a CURVE socket needs is absent, unreadable or readable by others."""


def rank_name(rank: int) -> str:
    return f"rank-{rank}"


def public_file(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}{PUBLIC_SUFFIX}"


def secret_file(directory: Path, name: str) -> Path:
    return Path(directory) / f"{name}{SECRET_SUFFIX}"


@dataclass(frozen=True)
class ServerKeys:
    """The ship worker's key pair and the public keys (z85) of the ranks it admits."""

    public: bytes
    secret: bytes
    ranks: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    """A rank's key pair and the ship worker's public key (z85)."""

    public: bytes
    secret: bytes
    server: bytes


def make_keys(directory: Path, ranks: int) -> list[tuple[str, bool]]:
    """The server's key pair and one per rank in `directory`: (name, made) for each, a pair
    of which either file is there kept (on a ship or rank host only one side's files are).
    A secret is created 0600 in a private (0700) directory and renamed into place, so it is
    never readable by others, not even while being written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    made = []
    for name in [SERVER, *(rank_name(rank) for rank in range(ranks))]:
        public, secret = public_file(directory, name), secret_file(directory, name)
        if public.exists() or secret.exists():
            made.append((name, False))
            continue
        with tempfile.TemporaryDirectory(dir=directory) as private:
            new_public, new_secret = zmq.auth.create_certificates(private, name)
            os.chmod(new_secret, 0o600)
            os.chmod(new_public, 0o644)
            os.replace(new_public, public)
            os.replace(new_secret, secret)
        made.append((name, True))
    return made


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    hint = '(`rlship keys` makes them; docs/scale-out.md, "On a shared network")'
    try:
        mode = path.stat().st_mode
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise MissingKey(f"CURVE key file {path}: {getattr(exc, 'strerror', None) or exc} {hint}") from None
    if secret and (secret_key is None or mode & (stat.S_IRWXG | stat.S_IRWXO)):
        problem = "holds no secret key" if secret_key is None else f"is readable by others: chmod 600 {path}"
        raise MissingKey(f"CURVE key file {path} {problem}")
    return public, secret_key


def server_keys(directory: Path, ranks: int) -> ServerKeys:
    public, secret = _load(secret_file(directory, SERVER), secret=True)
    assert secret is not None
    admitted = [_load(public_file(directory, rank_name(rank)), secret=False)[0] for rank in range(ranks)]
    return ServerKeys(public, secret, frozenset(admitted))


def client_keys(directory: Path, rank: int) -> ClientKeys:
    public, secret = _load(secret_file(directory, rank_name(rank)), secret=True)
    assert secret is not None
    return ClientKeys(public, secret, _load(public_file(directory, SERVER), secret=False)[0])


def serve(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Make `sock` (before it binds) a CURVE server: every peer must complete the handshake
    and pass the context's ZAP authenticator (`start_authenticator`)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def connect_as_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make `sock` (before it connects) a CURVE client of the ship worker's key."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server


class RankKeys:
    """The ZAP callback: a client key is admitted only if it is one of the run's ranks';
    each other key is logged once (a peer without the run's key is trying the port)."""

    def __init__(self, keys: ServerKeys, where: str) -> None:
        self.keys = keys.ranks
        self.where = where
        self._refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if key not in self._refused:
            self._refused.add(key)
            logger.warning(
                "%s: refused a CURVE peer whose key %s is none of the run's ranks' (further refusals "
                "of it not logged)", self.where, key.decode(errors="replace"),
            )  # fmt: skip
        return False


def start_authenticator(ctx: zmq.Context, keys: ServerKeys, where: str) -> ThreadAuthenticator:
    """A ZAP handler in `ctx` (a thread) admitting the run's rank keys; without one, libzmq
    lets any CURVE client in. Started before the sockets bind; stopped before `ctx.term()`."""
    authenticator = ThreadAuthenticator(ctx)
    authenticator.start()
    authenticator.configure_curve_callback("*", RankKeys(keys, where))
    return authenticator
