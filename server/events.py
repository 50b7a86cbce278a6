"""KV events for subscribers: Server-Sent Events and vLLM's ZMQ format (being built)."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter

__all__ = ["router", "start"]

router = APIRouter()


def start(svc: Any, settings: Any) -> Callable[[], None] | None:
    """Start what the events need beside the app (the ZMQ publisher); returns its closer."""
    return None
