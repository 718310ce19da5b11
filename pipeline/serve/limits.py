"""What a request may be, and the answer when it is not: every refusal an ``ApiError``, answered
with its status and an OpenAI-style JSON body, ``{"error": {"message", "type", "param",
"code"}}``; never a 500 for what a client sent.

A body is counted before it is parsed: a ``Content-Length`` over ``serve.max_body_bytes`` is
refused before a byte is read, and a body sent without one (chunked) is read only until it passes
the limit. Then it must be a JSON object, and each field what the route takes
(``embeddings_request``, ``search_request``)."""
from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
from typing import Any, Optional

from transforms.settings import ServeSettings

MAX_K = 1000
"""The most hits one search may ask for."""


class ApiError(Exception):
    """A request answered with ``status`` and an error body; ``code`` is the error's kind (the
    ``newsvec_serve_errors`` metric's label)."""

    def __init__(self, status: int, message: str, code: str, *,
                 type_: str = "invalid_request_error", param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.type, self.param, self.headers = type_, param, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, code: str = "invalid_value", param: Optional[str] = None) -> ApiError:
    """A 400: the request is not one the route takes."""
    return ApiError(400, message, code, param=param)


async def read_json(request, limit: int, timeout_s: float) -> dict[str, Any]:
    """The request's body as a JSON object, read only up to ``limit`` bytes (413 beyond: by its
    ``Content-Length`` before reading, or as it streams in) and within ``timeout_s`` (408
    after), declared ``application/json`` (415
    otherwise: what a cross-site form could post is never taken)."""
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the body must be sent as Content-Type: application/json, not "
                            f"{media[:100] or '(none)'!r}", "unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise bad("Content-Length is not a number", "invalid_header") from None
        if length > limit:
            raise _too_large(length, limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(size, limit)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {timeout_s:g} s "
                            "(serve.request_timeout_s)", "body_timeout") from None
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise bad("the body is not valid JSON (UTF-8)", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the body must be a JSON object, not {type(body).__name__}", "invalid_json")
    return body


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the body holds {size} bytes or more, over the limit of {limit} "
                         "(serve.max_body_bytes)", "body_too_large")


@dataclasses.dataclass(frozen=True)
class EmbeddingsRequest:
    """A ``POST /v1/embeddings`` body, checked."""

    inputs: list[str]
    document: bool  # input_type "document": embedded as the pipeline embeds an article
    dimensions: Optional[int]
    base64: bool


def embeddings_request(body: dict[str, Any], settings: ServeSettings,
                       served: tuple[str, ...]) -> EmbeddingsRequest:
    """``body`` checked (400 for a field of the wrong kind or beyond a limit; 404 for a model
    other than ``served``, its names)."""
    model = body.get("model")
    if model is not None and model not in served:
        raise ApiError(404, f"the model {str(model)[:200]!r} is not served here; this service "
                            f"serves {served[0]!r} (GET /info)", "model_not_found",
                       param="model")
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        raise bad("input must be a string or a list of strings", "invalid_input", "input")
    if not inputs:
        raise bad("input is an empty list", "invalid_input", "input")
    if len(inputs) > settings.max_inputs_per_request:
        raise bad(f"input holds {len(inputs)} inputs, over the limit of "
                  f"{settings.max_inputs_per_request} (serve.max_inputs_per_request)",
                  "too_many_inputs", "input")
    for i, text in enumerate(inputs):
        _check_text(text, f"input[{i}]", "input", settings)
    input_type = body.get("input_type", "query")
    if input_type not in ("query", "document"):
        raise bad("input_type must be \"query\" or \"document\"", param="input_type")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad("encoding_format must be \"float\" or \"base64\"", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise bad("dimensions must be a positive integer", param="dimensions")
    return EmbeddingsRequest(inputs, input_type == "document", dimensions, encoding == "base64")


@dataclasses.dataclass(frozen=True)
class SearchRequest:
    """A ``POST /v1/search`` body, checked."""

    query: str
    k: int
    all_copies: bool
    sources: tuple[str, ...]
    languages: tuple[str, ...]
    published_after: Optional[dt.datetime]
    published_before: Optional[dt.datetime]


def search_request(body: dict[str, Any], settings: ServeSettings) -> SearchRequest:
    """``body`` checked (400 for a field of the wrong kind or beyond a limit)."""
    query = body.get("query")
    if not isinstance(query, str):
        raise bad("query must be a non-empty string", "invalid_input", "query")
    _check_text(query, "query", "query", settings)
    k = body.get("k", 10)
    if type(k) is not int or not 1 <= k <= MAX_K:
        raise bad(f"k must be an integer from 1 to {MAX_K}", param="k")
    all_copies = body.get("all_copies", False)
    if not isinstance(all_copies, bool):
        raise bad("all_copies must be true or false", param="all_copies")
    return SearchRequest(query, k, all_copies, _strings(body, "source"),
                         _strings(body, "language"), _time(body, "published_after"),
                         _time(body, "published_before"))


def _check_text(text: str, name: str, param: str, settings: ServeSettings) -> None:
    """400 for an empty text, one over ``serve.max_input_chars``, or one that is not Unicode
    text (a lone surrogate, which JSON's ``\\ud800`` escape can send)."""
    if not text:
        raise bad(f"{name} is empty", "invalid_input", param)
    if len(text) > settings.max_input_chars:
        raise bad(f"{name} holds {len(text)} characters, over the limit of "
                  f"{settings.max_input_chars} (serve.max_input_chars)", "input_too_long", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{name} holds a lone surrogate: not Unicode text", "invalid_input",
                  param) from None


def _strings(body: dict[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key)
    values = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise bad(f"{key} must be a string or a list of strings", param=key)
    return tuple(values)


def _time(body: dict[str, Any], key: str) -> Optional[dt.datetime]:
    value = body.get(key)
    if value is None:
        return None
    try:
        when = dt.datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise bad(f"{key} must be an RFC 3339 time with an offset (2026-12-01T00:00:00Z)",
                  param=key)
    return when
