"""ZMQ + msgpack RPC between the API process (RpcClient, DEALER) and the engines (RpcServer,
ROUTER): unary and server-streaming calls, zero-copy array frames, flow control, deadlines,
cancellation, liveness and typed remote errors."""

from rpc.client import RpcClient, RpcStream
from rpc.codec import Codec
from rpc.errors import (
    ClientClosed,
    DeadlineExceeded,
    DecodeError,
    EncodeError,
    ProtocolError,
    RemoteError,
    RpcError,
    ServerUnavailable,
)
from rpc.loop_thread import LoopThread, new_event_loop
from rpc.server import RpcServer
from rpc.transport import IpcDir, new_ipc_address

__all__ = [
    "ClientClosed",
    "Codec",
    "DeadlineExceeded",
    "DecodeError",
    "EncodeError",
    "IpcDir",
    "LoopThread",
    "ProtocolError",
    "RemoteError",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "RpcStream",
    "ServerUnavailable",
    "new_event_loop",
    "new_ipc_address",
]
