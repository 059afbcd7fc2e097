"""GET /openapi.json with the request bodies in it. The routes read their bodies themselves
(app.py says why), so FastAPI cannot see them: each POST route's body model is added here,
with its sub-models under components/schemas, so schema fuzzers and client generators get
the same contract the routes enforce."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI, bodies: dict[str, list[type[BaseModel]]]) -> None:
    """`bodies`: path of a POST route -> the body models it takes (one of them)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            models = sorted({m for ms in bodies.values() for m in ms}, key=lambda m: m.__name__)
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            for path, ms in bodies.items():
                refs = [{"$ref": REF.format(model=m.__name__)} for m in ms]
                schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
                spec["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": schema}}}
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
