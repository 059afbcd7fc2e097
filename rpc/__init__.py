"""ZMQ + msgpack RPC between the API process (RpcClient, DEALER) and the engines (RpcServer,
ROUTER): unary and server-streaming calls, zero-copy array frames, flow control, deadlines,
cancellation, liveness and typed remote errors.

    codec = Codec(types=WIRE_TYPES)

    server = RpcServer(address, codec)            # engine side
    server.register_unary("stats", get_stats)     # async def get_stats() -> EngineStats
    server.register_stream("generate", generate)  # async def generate(req): ... yield out
    await server.start()

    client = RpcClient(address, codec)            # API side
    stats = await client.call("stats", timeout=1.0)
    async for out in client.stream("generate", request):
        ...

Thread-safety: RpcServer and RpcClient belong to the event loop they were started / first
used on and must only be used from that loop's thread, with two exceptions that any thread
may use: `RpcServer.call_soon_threadsafe` and dropping an `RpcStream` (its finalizer only
schedules the cancel). A Codec may be shared by any threads. `LoopThread` runs a loop in a
background thread for a process whose main thread runs a synchronous busy loop (the engine).

R1: `call` and `stream` keep no reference to their arguments once the envelope is posted;
zmq holds the array buffers until they are sent (copy=False), then releases them. The
server keeps none once the handler has them; a stream handler should drop its own (e.g.
`request = None`) as soon as the next stage holds the payload.
"""

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
