"""Endpoint helpers: private ipc:// socket paths and address checks.

ipc:// socket files live in a private directory (mode 0700, so other local users cannot
connect) that is removed on close. tcp:// works as zmq spells it; bind `tcp://127.0.0.1:*`
and read `RpcServer.address` to get a free port.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import threading

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_IPC_PATH = 107
_SCHEMES = ("ipc://", "tcp://", "inproc://")


def check_address(address: str) -> None:
    if not isinstance(address, str) or not address.startswith(_SCHEMES):
        raise ValueError(f"address must start with one of {_SCHEMES}, got {address!r}")
    if address.startswith("ipc://") and len(address) - len("ipc://") > MAX_IPC_PATH:
        raise ValueError(f"ipc path longer than {MAX_IPC_PATH} bytes: {address!r}")


class IpcDir:
    """A private (0700) temporary directory holding ipc:// socket files; `close()` (or
    leaving the `with` block) removes it and every socket file in it."""

    def __init__(self, prefix: str = "flatserve-rpc-") -> None:
        # /tmp rather than $TMPDIR: socket paths must stay under 108 bytes.
        base = "/tmp" if os.path.isdir("/tmp") else None
        self.path = tempfile.mkdtemp(prefix=prefix, dir=base)  # created with mode 0700
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
    """An ipc:// address in this process's private socket directory, which is removed when
    the process exits. Use `IpcDir` to control the directory's lifetime yourself."""
    global _process_dir
    with _process_dir_lock:
        if _process_dir is None or not os.path.isdir(_process_dir.path):
            _process_dir = IpcDir()
            atexit.register(_remove_if_owner, _process_dir, os.getpid())
        return _process_dir.address(name)


def _remove_if_owner(ipc_dir: IpcDir, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the atexit hook
        ipc_dir.close()
