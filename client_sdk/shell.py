"""What ``KVClient`` and ``AsyncKVClient`` set up the same way, written once.

Both clients take the same settings (``tests/client_sdk/test_surface.py`` holds
their signatures together) and keep the same state beside them: the stats, the
result pool, the co-located arena's state, the transport every call goes over and
the admin calls on it. ``ClientShell`` builds all of that; each client adds its
own parts over it (``client_sdk.client``: blocking, ``client_sdk.aio``: awaited).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from client_sdk import _common as c
from client_sdk import calls
from client_sdk.colocated import Colocation
from client_sdk.surface import AdminClient, DataCalls
from client_sdk.transport import RetryPolicy
from kvstore.keys import validate_namespace
from kvstore.planner import Decision
from kvstore.spec import KVSpec

__all__ = ["ClientShell"]


class ClientShell(DataCalls):
    """The settings and shared state of a client.

    Args:
        transport: ``HttpTransport`` or ``AsyncHttpTransport``; built here with the settings,
            and ``transport_options`` (the async pool bound).
        Others: as ``KVClient``'s.

    Attributes:
        http: the transport. admin: the operator's calls over it. stats: what this client did.
        colocation: the co-located arena's state. pool: result memory, reused.
    """

    puts: Any
    """The client's queue of puts that do not wait (``client_sdk.pending``)."""
    _planner: Any
    """The client's planner once built (None before)."""

    def __init__(self, transport: Callable[..., Any], url: str, token: str | None, namespace: str, *,
                 timeout_s: float | None, connect_timeout_s: float, retries: int, backoff_s: float,
                 colocated: bool | None, buffer_pool_bytes: int, plan: bool, slo_s: float | None,
                 redis_url: str | None, agent: str | None, **transport_options: Any) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.namespace = validate_namespace(namespace)
        self.agent = c.agent_id(agent)
        """Sent with every request (``x-kv-agent``): the server learns hand-offs between agents."""
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.colocated = colocated
        self.plan = plan
        self.slo_s = slo_s
        self.redis_url = redis_url
        self.stats = c.ClientStats()
        self.http = transport(self.url, token, self.namespace, timeout_s=timeout_s,
                              connect_timeout_s=connect_timeout_s, retry=RetryPolicy(retries, backoff_s),
                              stats=self.stats, agent=self.agent, **transport_options)
        self._run = self.http.run
        self.admin = AdminClient(self.http.run, self.namespace)
        self.colocation = Colocation(self.url, colocated)
        self.pool = c.TensorPool(buffer_pool_bytes)

    def _put_input(self, spec: KVSpec, tokens: Any, kv: Any, wait: bool,
                   handoff: str | None) -> tuple[KVSpec, np.ndarray, torch.Tensor]:
        """``put_kv``'s input, checked before anything is queued or sent; a queued put that failed
        unseen is raised first (``client_sdk.pending``)."""
        self.puts.raise_failed()
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        kv = c.validate_put(spec, toks, kv)
        calls.check_handoff(handoff, wait)
        return spec, toks, kv

    @property
    def last_decision(self) -> Decision | None:
        """The planner's latest decision (inputs, candidates, choice, reason, actual cost)."""
        return None if self._planner is None else self._planner.last
