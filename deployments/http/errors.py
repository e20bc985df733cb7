"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Every 4xx the API answers goes through ``error_response``; a 5xx goes through
``internal_error``, whose body names only an error id while the detail (exception
text, paths) goes to the log.
"""

import logging
import uuid
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

log = logging.getLogger(__name__)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type_: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    if type_ is None:
        type_ = {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable",
                 500: "internal_error"}.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def internal_error(what: str, detail: Any, status: int = 500, code: str = "internal_error") -> JSONResponse:
    """A 5xx whose body names only an error id; ``detail`` (an exception, a message that may
    hold paths) goes to the log."""
    eid = uuid.uuid4().hex[:12]
    log.error("%s [error id %s]: %s", what, eid, detail if isinstance(detail, str) else repr(detail))
    return error_response(status, f"{what} (error id {eid})", code=code)


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, int(-(-seconds // 1))))}


def validation_error_response(err: ValidationError | RequestValidationError) -> JSONResponse:
    errors = err.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return error_response(400, f"{where}: {first.get('msg')}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
                          param, "invalid_value")
