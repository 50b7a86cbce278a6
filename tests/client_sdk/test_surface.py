"""The blocking and the async client offer the same calls, with the same arguments.

``client_sdk.surface`` writes the simple calls once for both; the rest (put_kv, get_kv,
layer streams, the co-located block paths, the planner's calls) are written per client
over shared flows. This test holds the two surfaces together, so they cannot drift.
"""

import inspect

from client_sdk import AsyncKVClient, KVClient
from client_sdk.surface import AdminClient

LIFECYCLE = {"KVClient": {"close"}, "AsyncKVClient": {"aclose"}}
"""The one public difference: how each is closed (``with`` / ``async with``)."""


def _public(cls: type) -> dict[str, object]:
    return {name: member for name, member in inspect.getmembers(cls) if not name.startswith("_")}


def _shape(member: object) -> object:
    """A method's parameters (names, kinds, defaults), or the kind of a data attribute."""
    if isinstance(member, property):
        return "property"
    if callable(member):
        sig = inspect.signature(member)
        return [(p.name, p.kind, p.default) for p in sig.parameters.values()]
    return type(member).__name__


def test_sync_and_async_clients_have_the_same_public_methods_and_signatures():
    sync = {k: v for k, v in _public(KVClient).items() if k not in LIFECYCLE["KVClient"]}
    aio = {k: v for k, v in _public(AsyncKVClient).items() if k not in LIFECYCLE["AsyncKVClient"]}
    assert sorted(sync) == sorted(aio)
    different = {name: (_shape(sync[name]), _shape(aio[name])) for name in sync
                 if _shape(sync[name]) != _shape(aio[name])}
    assert different == {}


def test_the_constructors_take_the_same_arguments_but_the_async_pool_bound():
    sync = inspect.signature(KVClient.__init__).parameters
    aio = dict(inspect.signature(AsyncKVClient.__init__).parameters)
    assert aio.pop("max_connections").default == 8
    assert [(p.name, p.default) for p in sync.values()] == [(p.name, p.default) for p in aio.values()]


def test_async_data_calls_are_awaitable_and_sync_ones_are_not():
    """The same method body serves both: a blocking transport answers, an async one hands back a
    coroutine. Checked on the calls that do I/O of their own."""
    for name in ("put_kv", "get_kv", "get_kv_layers", "blocks_exist", "get_blocks_into", "put_blocks_with",
                 "wait_reports", "media", "flush"):
        assert inspect.iscoroutinefunction(getattr(AsyncKVClient, name)), name
        assert not inspect.iscoroutinefunction(getattr(KVClient, name)), name


def test_both_clients_carry_the_admin_calls_in_one_admin_client():
    admin = {name for name in _public(AdminClient)}
    assert {"evict", "pin", "unpin", "migrate", "stats", "tiers", "entries", "explain", "audit"} <= admin
    # the admin calls left the data clients: a tenant's client is not an operator's console
    assert not admin & (set(_public(KVClient)) - {"namespace"})
