"""Request bodies parsed and validated off the event loop.

FastAPI parses a body model's JSON and validates it on the event loop, where a large body (a
guided_choice of 100,000 strings is 2.3 MB; tools and messages can fill max_request_bytes) held
every stream still for tens of milliseconds. The endpoints read the raw body (BodyLimit has
buffered it) and call parse_body on a worker thread instead; there the JSON parser's C call
holds the interpreter (about 3 ms per MB of short strings on a fast core, 10 on a slow one), as
pydantic's validation does (4 ms for 100,000 strings on the slow one), so the app prepares bodies
from LARGE_BODY_BYTES on one at a time (app.py). Errors have FastAPI's shapes.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from .errors import APIError, from_validation

M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], raw: bytes) -> M:
    """`raw` as `model`; APIError (400) naming the field, or json_invalid when it is not JSON."""
    try:
        value = json.loads(raw) if raw else None
    except json.JSONDecodeError as error:
        raise APIError(f"the body is not valid JSON: JSON decode error at character {error.pos}: {error.msg}",
                       code="json_invalid") from None
    except (ValueError, RecursionError) as error:  # bytes that are not UTF-8; nesting past the stack
        raise APIError(f"the body could not be parsed as JSON: {type(error).__name__}: {error}",
                       code="json_invalid") from None
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise from_validation(error.errors(include_url=False)) from None

