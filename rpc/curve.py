"""ZMQ CURVE for engines on other hosts: the key folder, the sockets' settings, and who must
have keys.

A key folder (`flatserve keys --dir DIR` writes one; zmq's certificate files):

    DIR/server.key           the engine's public key         (read by the API)
    DIR/server.key_secret    the engine's key pair, mode 0600 (read by the engine)
    DIR/client.key           the API's public key
    DIR/client.key_secret    the API's key pair, mode 0600    (read by the API)
    DIR/authorized/*.key     the API public keys the engine accepts (read by the engine)

The engine's socket is a CURVE server whose ZAP handler (pyzmq's authenticator thread) admits
only the keys in authorized/; the API's sockets are CURVE clients that pin the engine's
public key. Traffic is encrypted both ways. Keys apply to tcp:// only: ipc:// sockets live in
a private 0700 folder on one host. A tcp:// address that is not loopback needs keys, or an
explicit `--insecure`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

SERVER = "server"
CLIENT = "client"
AUTHORIZED = "authorized"
KEY_LEN = 40  # a Z85-encoded 32-byte key
MAX_LOGGED_REFUSALS = 64  # distinct refused keys logged by one engine

FOLDER_HELP = (
    "folder of CURVE keys (`flatserve keys --dir DIR` writes one): server.key and "
    "server.key_secret (the engine's pair), client.key and client.key_secret (the API's "
    "pair), authorized/*.key (the API keys an engine accepts); used on tcp:// addresses")


class KeyFileError(ValueError):
    """A key folder or file that cannot be used; the message is one line naming it."""


@dataclass(frozen=True)
class ServerKeys:
    """What an engine needs: its own pair and the client keys it accepts."""

    public: bytes
    secret: bytes
    authorized: frozenset[bytes]


@dataclass(frozen=True)
class ClientKeys:
    """What the API needs: its own pair and the engine's public key."""

    public: bytes
    secret: bytes
    server_public: bytes


# ---- the key folder ---------------------------------------------------------------------


def write_keys(key_dir: str | os.PathLike, force: bool = False) -> list[Path]:
    """Write a server and a client key pair into `key_dir` and authorize the client; refuse
    to replace existing keys unless `force`. Returns the files written."""
    if not zmq.has("curve"):
        raise KeyFileError("this libzmq has no CURVE support")
    root = Path(key_dir)
    targets = [root / f"{n}{ext}" for n in (SERVER, CLIENT) for ext in (".key", ".key_secret")]
    targets.append(root / AUTHORIZED / f"{CLIENT}.key")
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise KeyFileError(f"{existing[0]} exists: keys are never replaced without --force")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    (root / AUTHORIZED).mkdir(mode=0o700, exist_ok=True)
    # create in a private (0700) folder, make the secrets 0600, then move into place: no
    # moment where a secret is readable by others
    staging = Path(tempfile.mkdtemp(prefix=".keys-", dir=root))
    try:
        for name in (SERVER, CLIENT):
            public, secret = zmq.auth.create_certificates(staging, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
        shutil.copyfile(staging / f"{CLIENT}.key", staging / "authorized.key")
        os.replace(staging / "authorized.key", root / AUTHORIZED / f"{CLIENT}.key")
        for name in (SERVER, CLIENT):
            for ext in (".key", ".key_secret"):
                os.replace(staging / f"{name}{ext}", root / f"{name}{ext}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return targets


def load_server_keys(key_dir: str | os.PathLike) -> ServerKeys:
    root = _folder(key_dir)
    public, secret = _load_pair(root / f"{SERVER}.key_secret")
    authorized_dir = root / AUTHORIZED
    if not authorized_dir.is_dir():
        raise KeyFileError(f"{authorized_dir} is missing: the engine accepts the API keys "
                           "(*.key) found there")
    authorized = frozenset(_load_public(p) for p in sorted(authorized_dir.glob("*.key")))
    if not authorized:
        raise KeyFileError(f"{authorized_dir} holds no *.key file: no API could connect")
    return ServerKeys(public, secret, authorized)


def load_client_keys(key_dir: str | os.PathLike) -> ClientKeys:
    root = _folder(key_dir)
    public, secret = _load_pair(root / f"{CLIENT}.key_secret")
    return ClientKeys(public, secret, _load_public(root / f"{SERVER}.key"))


def _folder(key_dir: str | os.PathLike) -> Path:
    if not zmq.has("curve"):
        raise KeyFileError("this libzmq has no CURVE support")
    root = Path(key_dir)
    if not root.is_dir():
        raise KeyFileError(f"{root} is not a folder of CURVE keys (flatserve keys --dir "
                           f"{root} writes one)")
    return root


def _load_public(path: Path) -> bytes:
    return _load(path)[0]


def _load_pair(path: Path) -> tuple[bytes, bytes]:
    public, secret = _load(path)
    if secret is None:
        raise KeyFileError(f"{path} holds no secret key")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise KeyFileError(f"{path} may be read by other users (mode {mode:04o}): chmod 600 it")
    if zmq.curve_public(secret) != public:
        raise KeyFileError(f"{path}: its public key does not belong to its secret key")
    return public, secret


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeyFileError(f"{path} is missing")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{path}: {e}") from None
    if len(public) != KEY_LEN or (secret is not None and len(secret) != KEY_LEN):
        raise KeyFileError(f"{path}: not a CURVE key (expected {KEY_LEN} Z85 characters)")
    return public, secret


# ---- who must have keys -----------------------------------------------------------------


def uses_curve(address: str) -> bool:
    """Keys apply to tcp:// addresses only."""
    return address.startswith("tcp://")


def is_loopback(address: str) -> bool:
    """Whether a tcp:// address stays on this host (127.0.0.0/8, ::1, localhost)."""
    host = address.removeprefix("tcp://").rpartition(":")[0]
    host = host.rpartition(";")[2]  # zmq's `source;destination` form
    host = host.removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name, `*`, or a host name: may reach the network


def check_plain_tcp(address: str, insecure: bool) -> None:
    """Refuse plain (keyless) tcp:// beyond loopback unless `insecure` says it is meant."""
    if uses_curve(address) and not is_loopback(address) and not insecure:
        raise ValueError(
            f"{address} is not a loopback address: give --curve-key-dir DIR (flatserve keys "
            "--dir DIR writes one) or --insecure for unauthenticated, unencrypted traffic")


# ---- sockets ----------------------------------------------------------------------------


def apply_keys(sock: zmq.Socket, keys: ServerKeys | ClientKeys) -> None:
    """Make `sock` a CURVE server or client; before bind/connect."""
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    if isinstance(keys, ServerKeys):
        sock.curve_server = True
    else:
        sock.curve_serverkey = keys.server_public


class _AuthorizedKeys:
    """The ZAP check: a client's key must be one of the authorized keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys
        self._refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if key not in self._refused and len(self._refused) < MAX_LOGGED_REFUSALS:
            self._refused.add(key)  # once per key: a refused client retries several times a second
            log.warning("refused a connection whose key %s is not in %s/", key.decode(),
                        AUTHORIZED)
        return False


def start_authenticator(ctx: zmq.Context, keys: ServerKeys) -> ThreadAuthenticator:
    """The ZAP handler of `ctx` (one per context), admitting only `keys.authorized`; start it
    before binding, stop it after closing."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", _AuthorizedKeys(keys.authorized))
    return auth
