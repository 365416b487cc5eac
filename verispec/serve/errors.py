"""OpenAI's error object, {"error": {"message", "type", "param", "code"}}, for every failure."""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

# A message echoes the bad value; a 20 MB value must not come back as a 20 MB error.
MAX_MESSAGE_CHARS = 1000
_echo = reprlib.Repr()
_echo.maxstring = _echo.maxother = 200
_echo.maxlist = _echo.maxdict = 10
_echo.maxlevel = 3


def echo(value: object) -> str:
    """repr(value), shortened (long strings, lists and dicts cut with '...')."""
    return _echo.repr(value)


class APIError(Exception):
    """A failure to report to the client: 400 for bad input (naming the parameter), 404 for an
    unknown model or route, 413 for a body over the limit, 500 when generation itself failed.
    Messages are cut at MAX_MESSAGE_CHARS."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} characters)"
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_validation(errors: Sequence[Mapping]) -> APIError:
    """The first problem pydantic found (its errors(), as a list); the parameter is the body
    field it concerns."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(f"the body is not valid JSON: {first.get('msg')}", None, code="json_invalid")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return APIError(f"{where}: {first.get('msg')} (got {echo(first.get('input'))})", param)


def _from_http(error: HTTPException) -> APIError:
    """Starlette's own errors (a body it could not parse, e.g. JSON nested too deep; an unknown
    route or method) in OpenAI's shape."""
    if error.status_code == 400:
        return APIError(f"the body could not be parsed as JSON: {error.detail}", None, code="json_invalid")
    return APIError(str(error.detail), None, status=error.status_code)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return await api_error(_, from_validation(error.errors()))

    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        return await api_error(_, _from_http(error))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
