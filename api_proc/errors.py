"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

400 bad input, 401 bad API key, 404 unknown model or route, 408 body too slow, 413 too large,
415 not JSON, 429 over budget, 503 no engine. 500 only for bugs. Messages never carry request payloads (R1): an error
built from a validation failure keeps the field path, never the input value.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api_proc.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)


class HTTPError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code)).model_dump()


class BadRequest(HTTPError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(HTTPError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(HTTPError):
    status = 404
    type = "not_found_error"


class RequestTimeout(HTTPError):
    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(HTTPError):
    status = 413
    type = "request_too_large"


class UnsupportedMediaType(HTTPError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class OverBudget(HTTPError):
    status = 429
    type = "rate_limit_error"
    code = "mm_budget_exceeded"


class EngineUnavailable(HTTPError):
    status = 503
    type = "service_unavailable"
    code = "engine_unavailable"


class EngineFailed(HTTPError):
    """The engine failed one request (a bug or resource failure on its side)."""

    status = 500
    type = "engine_error"


def error_response(err: HTTPError, *, close: bool = False) -> JSONResponse:
    """`close`: the request's body was not read to its end, so the connection ends here."""
    headers = {"connection": "close"} if close else None
    return JSONResponse(err.to_dict(), status_code=err.status, headers=headers)


_BOUNDS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})
# what pydantic puts in an error's location for the branch of a union it tried
_BRANCH_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_branch(part) -> bool:
    return isinstance(part, str) and (part in _BRANCH_NAMES or "[" in part)


def _readable(errors: list[dict]) -> list[dict]:
    """Errors as a client reads them: a union's branches that failed only because the value
    has another type ("Input should be a valid string" for a list of parts) are left out
    when another branch says what is wrong, and branch names are left out of locations."""
    def wrong_type_branch(e: dict) -> bool:
        return e.get("type", "").endswith("_type") and any(map(_is_branch, e.get("loc", ())))

    def location(loc: tuple) -> tuple:
        out, skip_tag = [], -1
        for i, x in enumerate(loc):
            if isinstance(x, str) and "tagged-union[" in x:
                skip_tag = i + 2  # list[tagged-union[...]], index, tag: the tag is not a field
            if not _is_branch(x) and i != skip_tag:
                out.append(x)
        return tuple(out)

    kept = [e for e in errors if not wrong_type_branch(e)] or errors
    return [{**e, "loc": location(e.get("loc", ()))} for e in kept]


def format_validation_errors(errors: list[dict]) -> str:
    """One line per problem, field path first; the offending input values are left out."""
    parts = []
    errors = _readable(errors)
    for e in errors[:8]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        msg = e.get("msg", "invalid").removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "not supported by this server"
        elif e.get("type") in _BOUNDS:  # pydantic's name for it too, as vLLM's texts have
            msg = f"{msg} [type={e['type']}]"
        parts.append(f"{loc}: {msg}" if loc else msg)
    if len(errors) > 8:
        parts.append(f"... and {len(errors) - 8} more")
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPError)
    async def _api_error(_: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(BadRequest(format_validation_errors(list(exc.errors()))))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err: HTTPError = NotFound(f"no route {request.method} {request.url.path}",
                                          code="route_not_found")
        elif exc.status_code == 405:
            err = BadRequest(f"method {request.method} not allowed on {request.url.path}",
                                  code="method_not_allowed")
            err.status = 405
        else:
            err = HTTPError(str(exc.detail))
            err.status = exc.status_code
            err.type = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return error_response(err)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(HTTPError(f"internal error: {type(exc).__name__}"))
