"""The wire between the API process and the engines: ZMQ, msgpack, zero-copy pixel frames.

    codec.py          the messages of shared/messages.py as frames, and back
    sockets.py        socket options and ipc:// addresses
    curve.py          CURVE keys for tcp:// beyond loopback
    engine_server.py  the engine's end: a ROUTER on a thread of its own

The API's end (one DEALER per engine, routing, per-request streams) is
api_proc/engine_client.py. One message per engine step goes back, whatever the number of
requests in it.
"""
