"""zmq sockets and their addresses.

ipc:// socket files live in a private directory (mode 0700, so other local users cannot
connect) that is removed on close; tcp:// works as zmq spells it, with CURVE keys where given
(rpc/curve.py).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import threading

import zmq

from rpc.curve import ClientKeys, ServerKeys, apply_keys

# Messages queued per pipe and direction. One message is one engine step (or one request),
# so this is far above any real depth; a ROUTER raises at the mark instead of dropping
# (ROUTER_MANDATORY), and the sender decides.
HWM = 10_000
RECONNECT_IVL_MS = 100
MAX_IPC_PATH = 107  # sockaddr_un.sun_path holds 108 bytes including the terminating NUL


def make_socket(ctx: zmq.Context, kind: int,
                keys: ServerKeys | ClientKeys | None = None) -> zmq.Socket:
    """A socket with the project's options; `keys` make it a CURVE server or client."""
    sock = ctx.socket(kind)
    if keys is not None:
        apply_keys(sock, keys)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if kind == zmq.ROUTER:
        # EHOSTUNREACH for a gone peer and EAGAIN at the high-water mark, never a silent drop
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    else:
        # queue only on a live connection: nothing is parked for a dead engine and replayed
        # to its successor after the request was already failed
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    return sock


def check_address(address: str) -> None:
    if not isinstance(address, str) or not address.startswith(("ipc://", "tcp://")):
        raise ValueError(f"address must start with ipc:// or tcp://, got {address!r}")
    if address.startswith("ipc://") and len(address) - len("ipc://") > MAX_IPC_PATH:
        raise ValueError(f"ipc path longer than {MAX_IPC_PATH} bytes: {address!r}")


class IpcDir:
    """A private (0700) temporary directory for ipc:// socket files; `close()` removes it
    and every socket file in it."""

    def __init__(self, prefix: str = "flatserve-rpc-") -> None:
        # /tmp rather than $TMPDIR: socket paths must stay under 108 bytes
        self.path = tempfile.mkdtemp(prefix=prefix, dir="/tmp" if os.path.isdir("/tmp") else None)
        os.chmod(self.path, 0o700)

    def address(self, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"ipc socket name must be [A-Za-z0-9_.-]+, got {name!r}")
        address = f"ipc://{os.path.join(self.path, name)}.sock"
        check_address(address)
        return address

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> IpcDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_process_dir: IpcDir | None = None
_process_dir_lock = threading.Lock()


def new_ipc_address(name: str) -> str:
    """An ipc:// address in this process's private socket directory, removed at exit."""
    global _process_dir
    with _process_dir_lock:
        if _process_dir is None or not os.path.isdir(_process_dir.path):
            _process_dir = IpcDir()
            atexit.register(_remove_if_owner, _process_dir, os.getpid())
        return _process_dir.address(name)


def _remove_if_owner(ipc_dir: IpcDir, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the atexit hook
        ipc_dir.close()
