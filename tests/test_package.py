"""The public surface, and rules that hold for the whole code base."""

import ast
import pathlib

import kvstore
import tiers

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ["kvstore", "tiers", "server", "client_sdk", "bench"]


def test_kvstore_public_surface():
    assert sorted(kvstore.__all__) == sorted({
        "__version__", "KVSpec", "EmbeddedStore", "KVStore", "StoreStats", "IndexEntry", "Settings", "Codec",
        "Tier", "TierStats", "BlockHash", "block_hashes", "to_hex", "from_hex",
        "KVStoreError", "InvalidInput", "InvalidSpec", "InvalidKV", "InvalidTokens", "InvalidKey",
        "FrameError", "CorruptFrame", "UnsupportedFrame", "BlockNotFound", "TierError", "TierUnavailable",
        "TierFull", "TierIOError", "StoreClosed", "NotDurable",
    })
    for name in kvstore.__all__:
        assert hasattr(kvstore, name)
    assert tiers.__all__ == ["MemoryTier"]


def _sources():
    for pkg in PACKAGES:
        yield from (ROOT / pkg).rglob("*.py")


def test_no_pickle_eval_or_builtin_hash():
    """No pickle (arbitrary code on load), no eval/exec, and no hash(): salted per process."""
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            if names & banned_modules:
                offenders.append(f"{path}:{node.lineno} imports {names & banned_modules}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"eval", "exec", "hash"}:
                offenders.append(f"{path}:{node.lineno} calls {node.func.id}()")
            if isinstance(node, ast.Attribute) and node.attr in {"load", "save"} and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch" and path != PICKLE_PEER:
                offenders.append(f"{path}:{node.lineno} uses torch.{node.attr} (pickle inside)")
    assert not offenders, offenders


PICKLE_PEER = ROOT / "bench" / "peers.py"
"""The one exemption: ``kvstore bench all`` measures the pickle-over-HTTP pattern users would
otherwise run (``torch.save`` out, ``torch.load(weights_only=True)`` back), in the bench alone."""


def test_the_pickle_peer_loads_weights_only():
    """The exempt file's loads use the restricted unpickler, and nothing else in it pickles."""
    tree = ast.parse(PICKLE_PEER.read_text())
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "load" and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"]
    assert loads and all(any(k.arg == "weights_only" and getattr(k.value, "value", None) is True
                             for k in n.keywords) for n in loads)


def test_imports_flow_one_way():
    """server -> kvstore -> tiers; tiers never import the store; the engine never imports server.

    Two entry points sit on top of everything and are exempt: ``kvstore/cli.py``
    (``kvstore serve`` starts the server, ``kvstore stats`` uses the SDK) and
    ``bench/`` (benchmarks drive the whole stack). The SDK reads a co-located
    server's arena through ``kvstore.memory.shm``, never through the tiers. One
    exception: the ``redis`` medium (``client_sdk/redis_direct.py``) reads the
    shared Redis tier's frames with that tier's own chunk-aware reader rather
    than a second copy of its layout. And the engine plug-ins
    (``kvstore/integrations/vllm.py``, ``sglang.py``, ``lmcache.py``), which the
    engines load by module path, compose the SDK (a client of a running server)
    with the engine's layout; nothing in the engine imports them.
    """
    rules = {
        "tiers": {"kvstore.store", "server", "client_sdk"},
        "kvstore": {"server", "client_sdk"},
        "client_sdk": {"server", "tiers", "kvstore.store"},
    }
    exempt = {ROOT / "kvstore" / "cli.py", ROOT / "client_sdk" / "redis_direct.py",
              *(ROOT / "kvstore" / "integrations" / f"{name}.py" for name in ("vllm", "sglang", "lmcache"))}
    bad = []
    for pkg, banned in rules.items():
        for path in (ROOT / pkg).rglob("*.py"):
            if path in exempt:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                for mod in mods:
                    if any(mod == b or mod.startswith(b + ".") for b in banned):
                        bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, bad
