"""``POST /v1/connectors/report``: an engine connector's counters, into ``svc.connectors``.

The board itself (what is kept, how it shows in ``/metrics``) is ``server.connector_board``.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request

from kvstore.errors import InvalidInput
from server.connector_board import COUNTERS, RETIRED
from server.errors import field_error
from server.requests import caller
from server.service import json_body, require

__all__ = ["router", "parse_report"]

_ENGINE = re.compile(r"^[a-z0-9_-]{1,32}$")
_INSTANCE = re.compile(r"^[\x21-\x7e]{1,160}$")
_MAX_COUNTER = 1e18


def parse_report(data: Any) -> tuple[str, str, dict[str, float]]:
    """``(engine, instance, counters)`` of a report body, or a 422 naming the field.

    Retired counter names (``connector_board.RETIRED``) are checked like the others, then left out.
    """
    engine = require(data, "engine", str)
    if not _ENGINE.fullmatch(engine):
        raise field_error(InvalidInput("must be 1-32 characters of [a-z0-9_-]"), "engine")
    instance = require(data, "instance", str)
    if not _INSTANCE.fullmatch(instance):
        raise field_error(InvalidInput("must be 1-160 printable ASCII characters without spaces"), "instance")
    counters = require(data, "counters", dict)
    unknown = sorted(set(counters) - set(COUNTERS) - RETIRED)
    if unknown:
        raise field_error(InvalidInput(f"unknown counters {unknown[:5]}; known: {list(COUNTERS)}"), "counters")
    for name, value in counters.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= _MAX_COUNTER:
            raise field_error(InvalidInput(f"must be a number in [0, {_MAX_COUNTER:g}], got {value!r}"),
                              f"counters.{name}")
    return engine, instance, {k: float(v) for k, v in counters.items() if k not in RETIRED}


router = APIRouter()


@router.post("/v1/connectors/report")
async def connectors_report(request: Request) -> dict:
    """An engine connector's cumulative counters, kept under the caller's namespace.

    Body: ``{"engine": "vllm", "instance": "<engine id>/<role>", "counters": {name: number}}``.
    """
    svc, _, ns = caller(request)
    engine, instance, counters = parse_report(await json_body(request))
    svc.connectors.report(ns, engine, instance, counters)
    return {"namespace": ns, "engine": engine}
