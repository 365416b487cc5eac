"""OpenAI's error object, {"error": {"message", "type", "param", "code"}}, for every failure."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


class APIError(Exception):
    """A failure to report to the client: 400 for bad input (naming the parameter), 500 when
    generation itself failed."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
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


def _from_validation(error: RequestValidationError) -> APIError:
    """The first problem pydantic found; the parameter is the body field it concerns."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        return APIError(f"the body is not valid JSON: {first.get('msg')}", None, code="json_invalid")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return APIError(f"{where}: {first.get('msg')} (got {first.get('input')!r})", param)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return await api_error(_, _from_validation(error))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
