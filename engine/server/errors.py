"""OpenAI error bodies `{"error": {"message", "type", "param", "code"}}` for every failure the API returns."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("specfleet.engine.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers; rendered as an OpenAI error body with the given status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Drop pydantic's union-branch tags ("str", "list[int]", "function-after[...]") from the path.
    parts = [p for p in parts if not (p[:1].isalpha() and ("[" in p or p in ("str", "int", "list", "float")))]
    return ".".join(parts) or None


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    param = _loc_to_param(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"request body is not valid JSON: {first.get('msg', '')}", None
    if kind == "extra_forbidden":
        return f"unsupported field '{param}': this server does not accept it", param
    if kind == "missing":
        return f"field '{param}' is required", param
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if not param:
        return f"invalid request body: {msg}", None
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"invalid '{param}'={shown}: {msg}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("event=internal_error error=%s", type(exc).__name__)
        return error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")
