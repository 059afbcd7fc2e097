"""GET /openapi.json as the routes really answer, for schema fuzzers and client generators.

The routes read their bodies themselves (app.py says why), so FastAPI cannot see them: each
POST route's body model is added here, with its sub-models under components/schemas. Each
route declares the statuses it answers with `responses=answers(...)`; 408 and 431 are added
to every route, as the HTTP protocol layer answers them before routing (http_protocol.py).
Every error answer carries the OpenAI-shaped body (api_proc/errors.py).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from api_proc.protocol import ErrorResponse

REF = "#/components/schemas/{model}"

ERRORS = {
    400: "The body does not parse, or asks for what this model or server cannot do",
    401: "Missing or wrong API key (Authorization: Bearer ...)",
    404: "The model named is not served here",
    408: "The request's line and headers, or its body, did not arrive in time",
    413: "The body, or an image or video in it, is too large",
    415: "The body is not declared as application/json",
    429: "Over the multimodal budget, or too many bodies being received at once; retry later",
    431: "The request's line and headers are too large",
    500: "The engine failed the request",
    503: "No engine can take the request (none is up, all are busy, or the server is stopping)",
}
BODY_ERRORS = (400, 408, 413, 415, 429)  # reading and parsing a JSON body (request_body.py)
ENGINE_ERRORS = (404, 500, 503)  # the model named, then the engine that runs the request
HEAD_ERRORS = (408, 431)  # every route: answered before routing (http_protocol.py)

SSE = "text/event-stream"

UNHEALTHY = {"description": "An engine is down, or none is configured", "content": {
    "application/json": {"schema": {
        "type": "object", "required": ["status", "reason"],
        "properties": {"status": {"const": "unhealthy"}, "reason": {"type": "string"},
                       "engines": {"type": "array", "items": {"type": "object"}}}}}}}


def answers(*errors: int, ok_types: tuple[str, ...] = ()) -> dict[int, dict]:
    """FastAPI's `responses=` for a route that answers `errors` with the OpenAI-shaped body,
    and its 200s as `ok_types` besides its response class's type."""
    out: dict[int, dict] = {
        status: {"model": ErrorResponse, "description": ERRORS[status]} for status in errors}
    if ok_types:
        out[200] = {"content": {t: {"schema": {"type": "string"}} for t in ok_types}}
    return out


def install_openapi(app: FastAPI, bodies: dict[str, list[type[BaseModel]]]) -> None:
    """`bodies`: path of a POST route -> the body models it takes (one of them)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models = sorted({m for ms in bodies.values() for m in ms} | {ErrorResponse},
                            key=lambda m: m.__name__)
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            for path, ms in bodies.items():
                refs = [{"$ref": REF.format(model=m.__name__)} for m in ms]
                schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
                spec["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": schema}}}
            for operation in (op for ops in spec["paths"].values() for op in ops.values()):
                operation["responses"] = _with_head_errors(operation["responses"])
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi


def _with_head_errors(responses: dict) -> dict:
    """`responses` with HEAD_ERRORS added, by status."""
    error = {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}
    for status in HEAD_ERRORS:
        responses.setdefault(str(status), {"description": ERRORS[status], "content": error})
    return dict(sorted(responses.items()))
