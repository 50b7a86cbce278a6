"""A cache backend's batch read and write by key, co-located, without per-page parsing or an
existence request: pages of one layout after the first are read by comparing layout bytes
(``codec.header_like``), each still checked for its namespace; a writer's existence check can
answer from the arena alone (``blocks_exist(ask_server=False)``)."""

from __future__ import annotations

import json

import pytest

from client_sdk import KVClient
from kvstore import KVStore, codec
from kvstore.keys import block_meta, meta_prefix, named_key, surely_names
from tests.client_sdk.test_reserved_put import _requests_by_route
from tests.server.conftest import ACME, BETA, TOKENS
from tests.server.test_blocks_by_key import FP, get, keys, payloads, put
from tiers.memory import MemoryTier
from tiers.shm import ShmTier

NS = "acme"
SIZE = 4096


def _sealed_put(client: KVClient, ks: list[bytes], data: list[bytes], metas: list[bytes]) -> int:
    at = [codec.raw_payload_offset(1, len(m)) for m in metas]

    def writer(i: int, view: memoryview) -> int:
        view[at[i]:at[i] + len(data[i])] = data[i]
        return codec.seal_raw(view, "uint8", (len(data[i]),), metas[i])
    return client.put_blocks_with(ks, [a + len(d) for a, d in zip(at, data)], writer)


def _padded(meta: bytes, length: int) -> bytes:
    """``meta`` with a pad field that brings it to ``length`` bytes (one layout for every page)."""
    grown = meta[:-1] + b',"pad":"' + b"x" * (length - len(meta) - 9) + b'"}'
    assert len(grown) == length and json.loads(grown)
    return grown


@pytest.mark.parametrize("pages", [3, 70])
def test_a_page_of_the_batchs_layout_naming_two_namespaces_is_a_miss(serve_app, pages):
    """Beta writes a frame under a key acme asks for, with acme's namespace first in its metadata
    and its own after (``json.loads``, and the server, take the last): acme's batch read, whose
    other pages share that frame's layout, must not hand it over."""
    store = KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], scrub_bytes_per_s=0)
    srv = serve_app(store, tokens=json.dumps(TOKENS))
    ks, data = keys(pages), payloads(pages, SIZE)
    hostile_key = named_key(NS, "test", "page-hostile")
    hostile = block_meta("beta", FP, 0)[:-1] + b',"ns":"beta"}'
    hostile = b'{"v":1,"ns":"acme",' + hostile[len(b'{"v":1,"ns":"beta",'):]
    assert json.loads(hostile)["ns"] == "beta" and hostile.startswith(meta_prefix(NS))
    length = max(len(hostile), len(block_meta(NS, FP, 2))) + 16
    with KVClient(srv.url, token=ACME, namespace=NS) as acme, \
            KVClient(srv.url, token=BETA, namespace="beta") as beta:
        metas = [_padded(block_meta(NS, FP, i), length) for i in range(pages)]
        assert _sealed_put(acme, ks, data, metas) == pages
        assert _sealed_put(beta, [hostile_key], [b"\xee" * SIZE], [_padded(hostile, length)]) == 1
        assert store.scrubber.caught_up(10.0)  # every frame verified by the server: the trusted path
        order = [ks[0], hostile_key, *ks[1:]]
        with KVClient(srv.url, token=ACME, namespace=NS) as reader:  # a fresh reader: first reads
            found, got = get(reader, order)
            assert found == [True, False] + [True] * (pages - 1)
            assert [got[i] for i in range(len(order)) if i != 1] == data and 1 not in got
            assert reader.stats.shm_frames_trusted == pages and reader.stats.shm_frames_verified == 0


def test_metadata_is_surely_a_namespaces_only_when_one_key_could_name_it():
    prefix = meta_prefix(NS)
    assert surely_names(block_meta(NS, FP, 0, sglang={"key": "k"}), prefix)
    assert not surely_names(block_meta("beta", FP, 0), prefix)
    later = b'{"v":1,"ns":"acme","spec":"f","depth":0,"ns":"beta"}'
    escaped = b'{"v":1,"ns":"acme","spec":"f","depth":0,"n\\u0073":"beta"}'
    nested = block_meta(NS, FP, 0, extra={"ns": "acme"})
    for unsure in (later, escaped, nested):  # parse these: the first two name beta to json.loads
        assert unsure.startswith(prefix) and not surely_names(unsure, prefix)
    assert json.loads(later)["ns"] == json.loads(escaped)["ns"] == "beta"


def test_a_header_of_the_same_layout_is_read_with_each_frames_own_checksum():
    metas = [block_meta(NS, FP, i) for i in range(2)]
    frames = []
    for i, (meta, body) in enumerate(zip(metas, payloads(2, SIZE))):
        buf = bytearray(codec.raw_payload_offset(1, len(meta)) + SIZE)
        at = codec.raw_payload_offset(1, len(meta))
        buf[at:] = body
        assert codec.seal_raw(memoryview(buf), "uint8", (SIZE,), meta) == len(buf)
        frames.append(bytes(buf))
    ref = codec.read_header(frames[0])
    layout = codec.layout_prefix(frames[0], 1)
    assert codec.header_like(frames[1], ref, layout) == codec.read_header(frames[1])
    assert codec.header_like(frames[1], ref, layout).body_checksum != ref.body_checksum
    assert codec.layout_matches(memoryview(frames[1]), ref, layout)
    other = bytearray(frames[1][:-1])  # one byte shorter: another layout
    assert codec.header_like(other, ref, layout) is None and not codec.layout_matches(memoryview(other), ref, layout)
    longer = block_meta(NS, FP, 10_000)  # another metadata length
    buf = bytearray(codec.raw_payload_offset(1, len(longer)) + SIZE)
    codec.seal_raw(memoryview(buf), "uint8", (SIZE,), longer)
    assert codec.header_like(bytes(buf), ref, layout) is None
    assert not codec.layout_matches(memoryview(bytes(buf))[:ref.frame_len], ref, layout)
    wider = bytearray(frames[1])
    wider[codec.layout_prefix(frames[1], 1).__len__() + 7] ^= 1  # a dim's byte (the last of the layout)
    assert not codec.layout_matches(memoryview(bytes(wider)), ref, layout)


def test_a_writers_existence_check_can_answer_from_the_arena_alone(serve_app):
    """``ask_server=False`` makes no request and sees only the arena: a page a lower tier holds
    reads absent, and putting it again stores nothing twice and loses nothing."""
    store = KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], background=False)
    srv = serve_app(store, tokens=json.dumps(TOKENS))
    ks, data = keys(8), payloads(8)
    with KVClient(srv.url, token=ACME, namespace=NS) as c:
        assert put(c, ks, data) == 8
        lower = [1, 4, 5]
        for i in lower:
            assert store.migrate(ks[i], store.tiers[1].name)
        assert c.blocks_exist(ks) == [True] * 8
        before = _requests_by_route(srv.url)
        assert c.blocks_exist(ks, ask_server=False) == [i not in lower for i in range(8)]
        assert _requests_by_route(srv.url) == before  # no request
        assert put(c, [ks[i] for i in lower], [data[i] for i in lower]) == len(lower)
        assert len(store.entries()) == 8
        found, got = get(c, ks)
        assert found == [True] * 8 and [got[i] for i in range(8)] == data


@pytest.mark.parametrize("ask_server", [True, False])
def test_an_http_clients_existence_check_asks_the_server(serve_app, ask_server):
    srv = serve_app(tokens=json.dumps(TOKENS))
    ks, data = keys(2), payloads(2)
    with KVClient(srv.url, token=ACME, namespace=NS, colocated=False) as c:
        put(c, ks[:1], data[:1])
        assert c.blocks_exist(ks, ask_server=ask_server) == [True, False]


@pytest.mark.parametrize("by_key", [False, True])
def test_a_slot_vouched_for_after_the_readers_look_up_is_not_hashed_by_it(serve_app, by_key):
    """The reader's look-up saw the slots unverified (the server's verifier behind a commit, as a
    hand-off's reader finds them); when it copies, it reads the verified word as it stands then."""
    from kvstore.keys import block_hashes
    from tests.conftest import make_kv, make_spec

    store = KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], background=False)  # no verifier of its own
    srv = serve_app(store)
    spec = make_spec()
    tokens, kv = list(range(64)), make_kv(spec, 64)
    ks = block_hashes(spec, tokens, NS)
    with KVClient(srv.url, namespace=NS, plan=False) as writer, KVClient(srv.url, namespace=NS, plan=False) as c:
        assert writer.put_kv(spec, tokens, kv) == 64
        if by_key:  # either look-up remembers the slots, as the index showed them: not verified
            assert c.blocks_exist(ks) == [True] * 4
        else:
            assert c.lookup(spec, tokens) == 64
        shm = store.tiers[0]
        for k in ks:  # what the verifier does once it has hashed each frame
            shm.vouch(k, shm.read_vouched(k, lambda _view, stamp, _vouched: stamp))
        if by_key:
            got: dict[int, bytes] = {}
            found = c.get_blocks_into(ks, lambda i, _header, payload: got.__setitem__(i, bytes(payload)))
            assert found == [True] * 4
            whole = b"".join(got[i] for i in range(4))
            assert whole == b"".join(kv[:, :, :, 16 * d:16 * (d + 1)].contiguous().numpy().tobytes() for d in range(4))
        else:
            out, n = c.get_kv(spec, tokens)
            assert n == 64 and out.equal(kv)
        assert c.stats.shm_frames_verified == 0 and c.stats.shm_frames_trusted == 4


@pytest.mark.parametrize("verified", [False, True])
def test_a_block_another_tenant_put_under_a_sequences_key_is_not_read_as_its_kv(serve_app, verified):
    """Token-chain keys are derived from the namespace, but anyone can compute them, and a put by
    key may name any key. Beta puts a frame of its own under the key of acme's first block, over
    HTTP; acme's co-located get finds the key in the arena's index and must not return beta's
    bytes as acme's KV (the server's own read path checks the entry's namespace)."""
    from kvstore.keys import block_hashes
    from tests.conftest import make_kv, make_spec

    store = KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], background=verified, scrub_bytes_per_s=0)
    srv = serve_app(store, tokens=json.dumps(TOKENS))
    spec = make_spec()
    tokens, kv = list(range(32)), make_kv(spec, 32)
    ks = block_hashes(spec, tokens, NS)
    frames = [codec.encode(make_kv(spec, 16) + 100, meta=block_meta("beta", spec.fingerprint(), d)) for d in (0, 1)]
    with KVClient(srv.url, token=BETA, namespace="beta", colocated=False) as beta:
        def write(i: int, view: memoryview) -> int:
            view[:len(frames[i])] = frames[i]
            return len(frames[i])
        assert beta.put_blocks_with(ks, [len(f) for f in frames], write) == 2
    if verified:
        assert store.scrubber.caught_up(10.0)
    with KVClient(srv.url, token=ACME, namespace=NS, plan=False) as acme:
        assert acme.lookup(spec, tokens) == 0
        got, n = acme.get_kv(spec, tokens)
        assert n == 0
        assert acme.put_kv(spec, tokens, kv) == 32  # acme's own put is not blocked by it, and reads back
        got, n = acme.get_kv(spec, tokens)
        assert n == 32 and got.equal(kv)


def test_frames_naming_two_namespaces_under_a_whole_sequences_keys_are_not_its_kv(serve_app):
    """As above, beta's frames under every key of a sequence of 70 blocks, each frame's metadata
    naming acme first and beta last (``json.loads`` takes beta): lookup, get_kv and the arena's
    existence check all find none of them acme's."""
    from kvstore.keys import block_hashes
    from tests.conftest import make_kv, make_spec

    store = KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], scrub_bytes_per_s=0)
    srv = serve_app(store, tokens=json.dumps(TOKENS))
    spec = make_spec()
    tokens = list(range(70 * 16))
    ks = block_hashes(spec, tokens, NS)
    metas = [block_meta(NS, spec.fingerprint(), d)[:-1] + b',"ns":"beta"}' for d in range(70)]
    assert all(json.loads(m)["ns"] == "beta" and m.startswith(meta_prefix(NS)) for m in metas)
    kv = make_kv(spec, 16) + 100
    frames = [codec.encode(kv, meta=m) for m in metas]
    with KVClient(srv.url, token=BETA, namespace="beta", colocated=False) as beta:
        def write(i: int, view: memoryview) -> int:
            view[:len(frames[i])] = frames[i]
            return len(frames[i])
        assert beta.put_blocks_with(ks, [len(f) for f in frames], write) == 70
    assert store.scrubber.caught_up(10.0)
    with KVClient(srv.url, token=ACME, namespace=NS, plan=False) as acme:
        assert acme.lookup(spec, tokens) == 0
        assert acme.get_kv(spec, tokens)[1] == 0
        assert acme.blocks_exist(ks, ask_server=False) == [False] * 70


@pytest.mark.parametrize("pooled", [True, False])
def test_pages_put_again_that_a_lower_tier_holds_are_not_charged_to_the_quota(serve_app, pooled):
    """Beta (a 1 MiB quota) stores 14 pages of 64 KiB, some move to a lower tier, and a writer that
    skipped only what the arena shows puts them again: stored once, so not charged again. Into
    pool slots, and through staging (a server that takes no pooled puts)."""
    store = KVStore([ShmTier(32 << 20), MemoryTier(64 << 20)], background=False)
    srv = serve_app(store, tokens=json.dumps(TOKENS), reserved_puts=pooled)
    ks, data = keys(14, "beta"), payloads(14, 64 << 10)
    with KVClient(srv.url, token=BETA, namespace="beta") as c:
        assert put(c, ks, data, ns="beta") == 14
        lower = [0, 5, 9, 13]
        for i in lower:
            assert store.migrate(ks[i], store.tiers[1].name)
        assert c.blocks_exist(ks, ask_server=False) == [i not in lower for i in range(14)]
        again = _sealed_put(c, [ks[i] for i in lower], [data[i] for i in lower],
                            [block_meta("beta", FP, i) for i in lower])  # the same frames as stored
        assert again == 4
        with pytest.raises(Exception, match="quota"):  # the quota itself still holds for new pages
            put(c, keys(20, "beta")[14:], payloads(20, 64 << 10)[14:], ns="beta")
        found, got = get(c, ks)
        assert found == [True] * 14 and [got[i] for i in range(14)] == data
