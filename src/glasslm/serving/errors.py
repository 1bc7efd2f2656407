"""Every error the app answers, in OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`.

Never a traceback: validation problems become 400s naming the field, unknown paths 404s, and
anything unexpected a 500 that names only the exception's type (the log has the rest).

Example:
    >>> error_response(429, "the server is busy", "overloaded").body
    b'{"error":{"message":"the server is busy","type":"overloaded","param":null,"code":429}}'
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from glasslm.generation.engine import ShuttingDown
from glasslm.serving.schemas import BadRequest, UnknownModel, describe_validation_error

log = logging.getLogger("glasslm.serving")


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def refused(err: Exception, engine: Any) -> JSONResponse:
    """The answer when the engine takes no more work: 429 with Retry-After (`Engine.retry_after`)
    for a full queue, 503 while shutting down."""
    if isinstance(err, ShuttingDown):
        return error_response(503, str(err), "unavailable")
    return error_response(429, str(err), "overloaded", headers={"Retry-After": str(engine.retry_after())})


async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    problem = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in problem.get("loc", ()) if p != "body"]
    where = "" if problem.get("type") == "json_invalid" else ".".join(loc)
    if loc and not where.strip():  # a field named "" (or spaces) is still a field: quote it
        where = repr(where)
    message = describe_validation_error(problem)
    return error_response(400, f"{where}: {message}" if where else message, param=where or None)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    message = str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in message:  # FastAPI's words for bad bytes
        message = "the request body could not be read: it must be JSON encoded as UTF-8"
    response = error_response(exc.status_code, message, kind)
    response.headers.update(exc.headers or {})  # a 405's Allow: the methods the path takes (RFC 9110)
    return response


# What /openapi.json says each error status means (`document_errors`), in OpenAI's error shape.
ERROR_SCHEMA = {"title": "Error", "type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}
ERRORS = {400: "a field is missing, of the wrong type or out of range (param names it), or the body is no JSON",
          404: "the model named is not the one this server serves (param: model)",
          429: "the queue is full: try again shortly"}


def document_errors(schema: dict[str, Any], not_found: set[str], busy: set[str]) -> dict[str, Any]:
    """`schema` (FastAPI's OpenAPI document) with the errors the app answers: 400 on every operation
    that takes a body or parameters (validation answers 400, never FastAPI's 422, which goes), 404 on
    the paths in `not_found`, 429 on those in `busy`; each in the shape of `ERROR_SCHEMA`."""
    schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    schema["components"]["schemas"].pop("HTTPValidationError", None)
    schema["components"]["schemas"].pop("ValidationError", None)
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            statuses = ({400} if "requestBody" in operation or operation.get("parameters") else set()) \
                | ({404} if path in not_found else set()) | ({429} if path in busy else set())
            for status in sorted(statuses):
                responses[str(status)] = {"description": ERRORS[status], "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return schema


async def _bad_input(request: Request, exc: BadRequest) -> JSONResponse:
    return error_response(400, str(exc), param=exc.param)


async def _unknown_model(request: Request, exc: UnknownModel) -> JSONResponse:
    return error_response(404, str(exc), "not_found", exc.param)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}", "server_error")


def add_error_handlers(app: FastAPI) -> None:
    handlers: tuple[tuple[type[Exception], Any], ...] = (
        (RequestValidationError, _bad_request), (HTTPException, _http_error), (BadRequest, _bad_input),
        (UnknownModel, _unknown_model),
        (Exception, _internal_error),
    )
    for exception, handler in handlers:
        app.add_exception_handler(exception, handler)
