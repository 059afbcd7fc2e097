"""flatserve: serve Qwen-VL models with flat host memory.

The Python SDK (`from flatserve import Client`) is flatserve/sdk.py; the `flatserve` command
(serve, engine, bench, soak, make-model) is flatserve/cli.py. The server itself is api_proc/
(the HTTP process), engine_proc/ (the engine processes), rpc/ (the wire between them) and
shared/ (what both import).
"""

__all__ = [
    "APIConnectionError",
    "APIError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "ChatResult",
    "Client",
    "InternalServerError",
    "NotFoundError",
    "OverBudgetError",
    "PayloadTooLargeError",
    "ServiceUnavailableError",
    "Usage",
]


def __getattr__(name: str):
    """The SDK's names, imported on first use: the `flatserve` command (whose processes import
    this package) does not pay for httpx and the client at every start."""
    if name in __all__:
        from flatserve import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'flatserve' has no attribute {name!r}")
