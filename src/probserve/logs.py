"""The processes' log lines: text or JSON (`--log-format`), each line of a request carrying its
request id (the client's `X-Request-Id`, sanitised, or one made for it)."""

from __future__ import annotations

import contextvars
import logging
import re
import sys
import uuid
from typing import Literal

LogFormat = Literal["text", "json"]

# the request id of the request whose code is running (the API process: set by its
# middleware for the request's task; "" outside any request)
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")

MAX_REQUEST_ID = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9._:\-]")


def request_id_from(header: str | None) -> str:
    """A client's X-Request-Id made safe to log and to echo: the characters of
    `[A-Za-z0-9._:-]` only, at most 64; a new random id where none (or nothing safe) is left."""
    if header:
        kept = _UNSAFE.sub("", header)[:MAX_REQUEST_ID]
        if kept:
            return kept
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Gives every record `request_id` (the running request's, or "") and `request_tag` (" [id]"
    where there is one, for the text format)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = getattr(record, "request_id", None) or REQUEST_ID.get()
        record.request_id = rid
        record.request_tag = f" [{rid}]" if rid else ""
        return True


def configure_logging(level: str, fmt: LogFormat = "text", process: str = "") -> None:
    """The root logger on stderr at `level`: text lines (`process` after the logger's name:
    "[worker]"), or one JSON object a line with the record's fields (python-json-logger), the
    access line's as fields of their own."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    formatter: logging.Formatter
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        formatter = JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            static_fields={"process": process.strip("[]") or "server"},
        )
    else:
        formatter = logging.Formatter(
            f"%(asctime)s %(levelname)s %(name)s{process}%(request_tag)s: %(message)s"
        )
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
