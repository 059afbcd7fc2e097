"""Every exception the rpc package raises. Catch `RpcError` to catch them all."""

from __future__ import annotations


class RpcError(Exception):
    """Base class of every rpc error."""


class EncodeError(RpcError):
    """A value cannot be put on the wire (unsupported type, GPU tensor, unregistered class)."""


class DecodeError(RpcError):
    """Bytes received from a peer do not decode to a valid value or envelope."""


class ProtocolError(RpcError):
    """The peer broke the protocol (for example, sent more stream items than it had credit for)."""


class DeadlineExceeded(RpcError, TimeoutError):
    """The call's deadline passed before it finished; the server stops the work too."""


class ServerUnavailable(RpcError, ConnectionError):
    """The server is gone (process died, missed heartbeats, shut down) or not reachable yet."""


class ClientClosed(RpcError):
    """The client was closed while the call was pending, or a call was made after close()."""


class RemoteError(RpcError):
    """The remote handler raised. Carries the remote exception's type name, message and
    traceback text (never the exception object itself: nothing is pickled)."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback
        if remote_traceback and hasattr(self, "add_note"):  # Python >= 3.11
            self.add_note(f"remote traceback:\n{remote_traceback.rstrip()}")
