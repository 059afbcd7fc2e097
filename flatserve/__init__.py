"""flatserve: serve Qwen-VL models with flat host memory.

The Python SDK (`from flatserve import Client`) is flatserve/sdk.py; the `flatserve` command
(serve, engine, bench, soak, make-model) is flatserve/cli.py. The server itself is api_proc/
(the HTTP process), engine_proc/ (the engine processes), rpc/ (the wire between them) and
shared/ (what both import).
"""

from flatserve.sdk import (
    APIConnectionError,
    APIError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    ChatResult,
    Client,
    InternalServerError,
    NotFoundError,
    OverBudgetError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    Usage,
)

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
