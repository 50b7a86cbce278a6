"""kvstore as a vLLM v1 KV connector: ``KVStoreConnector``.

Configure it with::

    --kv-transfer-config '{"kv_connector":"KVStoreConnector",
        "kv_connector_module_path":"kvstore.integrations.vllm", "kv_role":"kv_both",
        "kv_load_failure_policy":"recompute",
        "kv_connector_extra_config":{"url":"http://127.0.0.1:8470","namespace":"default"}}'

It talks to a running ``kvstore serve`` through the SDK (shared memory on the
same host, HTTP otherwise). Blocks are stored under kvstore's own chained keys
over the token ids, in the canonical ``[L, 2, H, T, D]`` layout, with a
``KVSpec`` derived from the model (``spec_from_vllm``): so a transformers agent
using ``kvstore.integrations.hf.spec_for`` with the same model id, weights
fingerprint and block size reads what vLLM stored, and the reverse.

Scheduler side: ``get_num_new_matched_tokens`` answers from one lookup per
request (cached until the request is scheduled), aligned to the block size and
never covering the last prompt token; the loads and saves it plans ride to the
worker in ``KVStoreConnectorMetadata``. Worker side: ``vllm_transfer.Load`` and
``vllm_transfer.Saver``. A request that had a save keeps its blocks
(``request_finished`` answers True) until the worker reports the save done.
Both sides count what they did (``vllm_transfer.Counters``: tokens looked up, offered,
loaded and saved) for vLLM's stats and for the server (``POST /v1/connectors/report``).

Extra config keys: ``url`` (default ``$KVSTORE_URL`` or ``http://127.0.0.1:8470``),
``namespace`` (``default``), ``token`` (default ``$KVSTORE_TOKEN``),
``fingerprint`` (default: ``weights_fingerprint`` of the model directory),
``model_id`` (default: the served model name), ``save_decode`` (default true: at a
request's end, also save the full blocks of what it generated), ``timeout_s`` (10),
``colocated`` (default null: shared memory when the server is on this host; false: HTTP always),
``layerwise`` (default null: layer by layer over HTTP or into a GPU, all layers before the forward
pass from this host's shared memory into a CPU cache; ``vllm_transfer.Load`` has the figures).

Refused at start-up, with the reason: tensor or pipeline parallelism, MLA,
sliding-window, hybrid and other non-full-attention KV, a quantized KV cache
(``kv_cache_dtype`` other than ``auto``), and dtypes the store has no spec for.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import blake3
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from client_sdk import KVClient
from kvstore.errors import InvalidSpec
from kvstore.integrations.vllm_layout import PagedLayout, layout_for
from kvstore.integrations.vllm_transfer import Counters, Load, LoadJob, Reporter, Saver, SaveJob
from kvstore.integrations.weights import weights_fingerprint
from kvstore.spec import DTYPES, KVSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreConnectorStats", "spec_from_vllm",
           "connector_settings"]

log = logging.getLogger("kvstore.integrations.vllm")

_LAYER = re.compile(r"layers\.(\d+)\.")
_LOOKUP_BACKOFF_S = (2.0, 30.0)
"""After a failed lookup, new requests skip the store (they recompute) for 2 s, doubling with each
failure up to 30 s, instead of each paying a timeout against a store that is down or hung."""
_LOOKUP_TIMEOUT_S = 1.0
"""A lookup runs inside vLLM's scheduler: an answer slower than this is a miss, not a stall."""
_FAILURES_KEPT = 64
"""Load-failure reports the worker remembers for saves planned before the scheduler took them in."""
_PREEMPT_WAIT_S = 60.0
_REPORT_INTERVAL_S = 5.0


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    """What the scheduler hands the worker for one step."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


class KVStoreConnectorStats(KVConnectorStats):
    """kvstore's counters in vLLM's connector stats (summed over workers and intervals).

    vLLM sums the scheduler's and the workers' counters of an interval and logs them on its
    "KV Transfer metrics" line, with ``hit_ratio``: loaded over looked-up tokens, the share of
    what vLLM asked kvstore about that kvstore put into its cache (``vllm_transfer.Counters``).
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVStoreConnectorStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}
        looked = self.data.get("looked_up_tokens", 0)
        if looked:
            out["hit_ratio"] = round(self.data.get("loaded_tokens", 0) / looked, 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def connector_settings(extra: dict[str, Any]) -> dict[str, Any]:
    """The connector's settings from ``kv_connector_extra_config``, defaults filled in.

    Raises:
        InvalidSpec: an unknown key or a value of the wrong type.
    """
    known = {"url", "namespace", "token", "fingerprint", "model_id", "save_decode", "timeout_s", "colocated",
             "layerwise", "name_blocks"}
    unknown = set(extra) - known
    if unknown:
        raise InvalidSpec(f"unknown kv_connector_extra_config keys {sorted(unknown)}; known: {sorted(known)}")
    out = {
        "url": extra.get("url") or os.environ.get("KVSTORE_URL") or "http://127.0.0.1:8470",
        "namespace": extra.get("namespace") or "default",
        "token": extra.get("token") or os.environ.get("KVSTORE_TOKEN") or None,
        "fingerprint": extra.get("fingerprint"),
        "model_id": extra.get("model_id"),
        "save_decode": extra.get("save_decode", True),
        "timeout_s": extra.get("timeout_s", 10.0),
        "colocated": extra.get("colocated"),
        "layerwise": extra.get("layerwise"),
        "name_blocks": extra.get("name_blocks"),
    }
    if out["colocated"] not in (None, True, False):
        raise InvalidSpec(f"colocated must be true, false or null, got {out['colocated']!r}")
    if out["name_blocks"] not in (None, True, False):
        raise InvalidSpec(f"name_blocks must be true, false or null, got {out['name_blocks']!r}")
    if out["layerwise"] not in (None, True, False):
        raise InvalidSpec(f"layerwise must be true, false or null, got {out['layerwise']!r}")
    if not isinstance(out["save_decode"], bool):
        raise InvalidSpec(f"save_decode must be true or false, got {out['save_decode']!r}")
    if isinstance(out["timeout_s"], bool) or not isinstance(out["timeout_s"], (int, float)) or out["timeout_s"] <= 0:
        raise InvalidSpec(f"timeout_s must be a positive number, got {out['timeout_s']!r}")
    return out


def _refuse_unsupported(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> None:
    """Raise ``InvalidSpec`` naming why this engine's KV cannot be stored as canonical full-attention KV."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    why = []
    if pc.tensor_parallel_size > 1 or pc.pipeline_parallel_size > 1:
        why.append(f"tensor/pipeline parallelism ({pc.tensor_parallel_size}x{pc.pipeline_parallel_size}): "
                   "each rank holds a shard of the heads or layers")
    if mc.use_mla:
        why.append("MLA: the cache holds a latent, not K and V")
    if mc.get_sliding_window() is not None or "sliding_attention" in (
            getattr(mc.hf_text_config, "layer_types", None) or ()):
        why.append("sliding-window attention: layers keep fewer tokens than the prefix")
    if cc.cache_dtype != "auto":
        why.append(f"kv_cache_dtype={cc.cache_dtype!r}: a quantized cache has no canonical KV")
    if mc.dtype not in DTYPES.values():
        why.append(f"dtype {mc.dtype}: the store keeps {sorted(DTYPES)}")
    if kv_cache_config is not None:
        groups = kv_cache_config.kv_cache_groups
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec or \
                groups[0].kv_cache_spec.sliding_window is not None:
            why.append(f"KV cache groups {kinds}: only one group of plain full attention is stored "
                       "(hybrid, sliding-window, chunked-local and Mamba layers are not)")
    if why:
        raise InvalidSpec("kvstore's vLLM connector cannot serve this engine: " + "; ".join(why))


def spec_from_vllm(vllm_config: "VllmConfig", settings: dict[str, Any]) -> KVSpec:
    """The ``KVSpec`` of this engine's KV: model id, layers, KV heads, head dim, dtype, block size, weights.

    The fingerprint is ``settings["fingerprint"]`` or, by default, ``weights_fingerprint`` of the
    model's directory (a local path, or the Hugging Face cache's snapshot of it).
    """
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    fingerprint = settings.get("fingerprint") or weights_fingerprint(_model_dir(mc))
    overrides = mc.hf_overrides
    if callable(overrides):  # a function's name, not its address: the same across processes
        overrides = f"{overrides.__module__}.{overrides.__qualname__}"
    engine_side = {"quantization": mc.quantization, "hf_overrides": overrides or None}
    if any(engine_side.values()):  # the same files, other numbers: their KV must not mix
        digest = blake3.blake3(json.dumps(engine_side, sort_keys=True, default=str).encode()).hexdigest()[:16]
        fingerprint = f"{fingerprint}+engine-{digest}"
    tag = _unverified_layout(vllm_config)
    if tag is not None:
        log.warning("vLLM's CPU attention runs the %r kernels here, whose cache layout kvstore has not "
                    "checked against transformers: blocks are shared only with engines running them too", tag)
        fingerprint = f"{fingerprint}+vllm-cpu-{tag}"
    name = settings.get("model_id") or (mc.served_model_name if isinstance(mc.served_model_name, str)
                                        else None) or mc.model
    model_id = re.sub(r"[^\x21-\x7e]", "_", str(name))[:256]
    return KVSpec(model_id, mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size(), mc.dtype,
                  cc.block_size, fingerprint=fingerprint)


def _unverified_layout(vllm_config: "VllmConfig") -> str | None:
    """The CPU attention ISA when it is not one whose layout was checked (``vllm_layout``), else None."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: SLF001 (the CPU ISA vLLM picks)

        isa = _get_attn_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)
    except Exception:  # a vLLM without that helper: not checked either
        return "unknown"
    return None if isa == "vec" else str(isa)


def _model_dir(mc: Any) -> str:
    if os.path.isdir(mc.model):
        return mc.model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(mc.model, revision=mc.revision, local_files_only=True)
    except Exception as exc:  # no local snapshot: the caller must name the weights
        raise InvalidSpec(f"cannot fingerprint the weights of {mc.model!r} ({exc}); set "
                          "kv_connector_extra_config.fingerprint") from exc


def _log_with_vllm() -> None:
    """Hand the ``kvstore`` logger vLLM's own handlers when no handler would take its records.

    vLLM's logging config gives handlers to its ``vllm`` logger alone, so under ``vllm serve``
    the connector's lines (its start-up line, failed loads and saves) reached none: Python's last
    resort prints bare warnings and drops the rest. A handler of the user's (on the root logger,
    or on ``kvstore`` through ``VLLM_LOGGING_CONFIG_PATH``) wins, and with ``VLLM_CONFIGURE_LOGGING=0``
    vLLM has none to lend.
    """
    ours, theirs = logging.getLogger("kvstore"), logging.getLogger("vllm")
    if ours.hasHandlers() or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:  # VLLM_LOGGING_LEVEL then sets ours too
        ours.setLevel(theirs.level)


@dataclass(slots=True)
class _Asked:
    """One admission of a request, from vLLM's first question until it schedules the request.

    vLLM asks again each step while it finds no room for a request: the store is looked up once,
    and the figures are counted once, when vLLM allocates for it (``update_state_after_alloc``).
    """

    held: int  # prompt tokens kvstore holds: whole blocks, never the last token
    looked_up: int = 0  # tokens vLLM asked about last: the request's, past those it computed or cached itself
    offered: int = 0  # what the connector answered: held, past those vLLM has


@dataclass
class _Tracked:
    """The scheduler's view of one request."""

    request: Any
    saved: int = 0  # tokens (whole blocks) known stored or queued for saving
    saving: bool = False  # some save was handed to the worker: its blocks wait for it at the end


class KVStoreConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector over a kvstore server (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        _log_with_vllm()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _refuse_unsupported(vllm_config, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = connector_settings(extra)
        self.spec = spec_from_vllm(vllm_config, self.settings)
        self.block_size = self.spec.block_tokens
        self.counters = Counters()
        self.client = KVClient(self.settings["url"], token=self.settings["token"],
                               namespace=self.settings["namespace"], timeout_s=self.settings["timeout_s"],
                               connect_timeout_s=min(2.0, self.settings["timeout_s"]), retries=1, plan=False,
                               colocated=self.settings["colocated"])
        lookup_s = min(_LOOKUP_TIMEOUT_S, self.settings["timeout_s"])
        # Co-located, a lookup whose blocks are all in the server's arena is answered from its
        # shared key index with no request (``KVClient.lookup``); the rest ask over HTTP
        self._lookups = KVClient(self.settings["url"], token=self.settings["token"],
                                 namespace=self.settings["namespace"], timeout_s=lookup_s,
                                 connect_timeout_s=lookup_s, plan=False, colocated=self.settings["colocated"],
                                 retries=1)  # a kept-alive connection the server closed is redialled
        instance = f"{self._kv_transfer_config.engine_id}/{role.name.lower()}"
        self._reporter = Reporter(lambda counters: self.client.report_connector("vllm", instance, counters),
                                  self.counters, _REPORT_INTERVAL_S)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is %r: a block kvstore cannot deliver fails its request; "
                        "set it to \"recompute\" so vLLM recomputes instead",
                        self._kv_transfer_config.kv_load_failure_policy)
        log.info("kvstore connector (%s) on %s, namespace %s, spec %s fingerprint %s", role.name,
                 self.settings["url"], self.settings["namespace"], self.spec.model_id, self.spec.weights_fingerprint)
        # scheduler side
        self._asked: dict[str, _Asked] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: dict[str, LoadJob] = {}
        self._finish_saves: list[SaveJob] = []
        # vLLM hashes prompts at this granularity (set by its engine core): its block hashes name
        # our blocks only where it is our block size
        self._hash_block_size = getattr(vllm_config.cache_config, "hash_block_size", None)
        self._down_until = 0.0
        self._down_for = 0.0
        # worker side
        self._layout: PagedLayout | None = None
        self._layer_index: dict[str, int] = {}
        self._saver: Saver | None = None
        self._load: Load | None = None
        self._load_errors: set[int] = set()
        self._failures: collections.deque[set[int]] = collections.deque(maxlen=_FAILURES_KEPT)
        self._failures_reported = 0  # worker: non-empty load-error reports handed to vLLM
        self._failures_seen = 0  # scheduler: those taken in (update_connector_output)
        self._saving: set[str] = set()  # requests that had a save: reported once finished and saved
        self._finishing: set[str] = set()
        self._lock = threading.Lock()

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save dropped by a preemption is a later miss, not lost data."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads need ``wait_for_layer_load`` to run, which a full CUDA graph skips."""
        return extra_config.get("layerwise") is not False

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        req_id = request.request_id
        asked = self._asked.get(req_id)
        if asked is None:
            asked = self._asked[req_id] = _Asked(self._lookup(request))
        asked.looked_up = request.num_tokens - num_computed_tokens
        asked.offered = max(0, asked.held - num_computed_tokens)
        return asked.offered, False

    @staticmethod
    def _unshareable(request: "Request") -> str | None:
        """Why ``request``'s KV is not a function of its token ids alone (then it is neither looked up
        nor saved), or None."""
        if request.mm_features:
            return "multimodal inputs (placeholder token ids stand for different images)"
        if request.lora_request is not None:
            return "a LoRA adapter (its KV differs from the base model's)"
        if request.cache_salt:
            return "a cache_salt (it asks for KV kept apart from other requests)"
        if request.prompt_embeds is not None:
            return "prompt embeddings instead of token ids"
        return None

    def _lookup(self, request: "Request") -> int:
        why = self._unshareable(request)
        if why is not None:
            log.debug("request %s not looked up in kvstore: %s", request.request_id, why)
            return 0
        tokens = request.all_token_ids
        usable = (len(tokens) - 1) // self.block_size * self.block_size  # the last token is always computed
        if usable <= 0:
            return 0
        if time.monotonic() < self._down_until:
            return 0
        try:
            hit = min(usable, self._lookups.lookup(self.spec, list(tokens[:usable])))
        except Exception as exc:  # a store that is down is a miss: vLLM computes the prefill
            first, most = _LOOKUP_BACKOFF_S
            self._down_for = min(most, self._down_for * 2 or first)
            self._down_until = time.monotonic() + self._down_for
            log.warning("kvstore lookup failed, recomputing for %.0f s: %s", self._down_for, exc)
            self.counters.add(lookup_errors=1)
            return 0
        self._down_for = 0.0
        self.counters.add(lookups=1)
        return hit

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        asked = self._asked.pop(req_id, None) or _Asked(0)
        hit = asked.held
        self.counters.add(looked_up_tokens=asked.looked_up, offered_tokens=asked.offered)
        tracked = self._tracked.get(req_id)
        if tracked is None:
            if self._unshareable(request) is not None:
                return  # never tracked: no loads, no saves
            tracked = self._tracked[req_id] = _Tracked(request)
        tracked.saved = max(tracked.saved, hit)
        if num_external_tokens <= 0:
            return
        bs = self.block_size
        if num_external_tokens > hit:  # vLLM asks for more than this request's lookup found: load nothing,
            # and name every block so vLLM recomputes rather than reads what they happen to hold
            log.error("vLLM scheduled %d external tokens for %s, kvstore's lookup found %d; recomputing",
                      num_external_tokens, req_id, hit)
            ids = list(blocks.get_block_ids()[0][:-(-num_external_tokens // bs)])
            self._loads[req_id] = LoadJob(req_id, [], 0, ids)
            return
        start = hit - num_external_tokens
        first = start // bs  # a start inside a block reloads the whole block: the same KV
        block_ids = list(blocks.get_block_ids()[0][first:hit // bs])
        self._loads[req_id] = LoadJob(req_id, list(request.all_token_ids[:hit]), first * bs, block_ids)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(preempted=sorted(scheduler_output.preempted_req_ids or ()))
        bs = self.block_size
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            load = self._loads.pop(req_id, None)
            if load is not None:
                meta.loads.append(load)
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            # KV computed once this step ran, up to the prompt's end: a prompt is saved as its prefill
            # completes (chunk by chunk), generated blocks at the request's end (save_decode).
            done = min(request.num_computed_tokens + n, request.num_prompt_tokens)
            end = done // bs * bs
            if end > tracked.saved:
                block_ids = self._kv_cache_manager.get_block_ids(req_id)[0][:end // bs]
                meta.saves.append(SaveJob(req_id, list(request.all_token_ids[:end]), list(block_ids),
                                          self._failures_seen, self._engine_names(request, end // bs)))
                tracked.saved, tracked.saving = end, True
        for job in self._finish_saves:
            job.seen = self._failures_seen
        meta.saves.extend(self._finish_saves)
        self._finish_saves = []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks whose load failed are recomputed by vLLM: save them again once they are."""
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        self._failures_seen += 1
        bs = self.block_size
        for req_id, tracked in self._tracked.items():
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            bad = [i for i, b in enumerate(block_ids[:tracked.saved // bs]) if b in invalid]
            if bad:
                tracked.saved = bad[0] * bs

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._asked.pop(req_id, None)
        self._loads.pop(req_id, None)
        tracked = self._tracked.pop(req_id, None)
        if tracked is None:
            return False, None
        if self.settings["save_decode"]:
            computed = min(request.num_computed_tokens, request.num_tokens - 1)
            end = min(computed // self.block_size, len(block_ids)) * self.block_size
            if end > tracked.saved:
                self._finish_saves.append(SaveJob(req_id, list(request.all_token_ids[:end]),
                                                  list(block_ids[:end // self.block_size]),
                                                  hashes=self._engine_names(request, end // self.block_size)))
                tracked.saving = True
        return tracked.saving, None

    def _engine_names(self, request: "Request", n: int) -> list[Any] | None:
        """vLLM's hashes of the request's first ``n`` blocks, as its own KV events write them, or
        None where they do not name our blocks (hashed at another block size) or naming is off."""
        if self.settings["name_blocks"] is False or self._hash_block_size not in (None, self.block_size):
            return None
        hashes = getattr(request, "block_hashes", None) or []
        if len(hashes) < n:
            return None
        return [maybe_convert_block_hash(h) for h in hashes[:n]]

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def index(name: str) -> int:
            m = _LAYER.search(name)
            if m is None:
                raise InvalidSpec(f"cannot tell the layer index of KV cache {name!r}")
            return int(m.group(1))

        names = sorted(kv_caches, key=index)
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._layout = layout_for([kv_caches[n] for n in names], self.spec)
        self._saver = Saver(self.client, self.spec, self._layout, self.counters,
                            name_blocks=self.settings["name_blocks"])
        log.info("kvstore connector: %d layers, %s layout, %d-token blocks", len(names), self._layout.kind,
                 self.block_size)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.loads or self._layout is None:
            return
        self._load = Load(self.client, self.spec, self._layout, meta.loads, self.counters,
                          layerwise=self.settings["layerwise"])

    def wait_for_layer_load(self, layer_name: str) -> None:
        load = self._load
        if load is not None:
            load.wait(self._layer_index[layer_name])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Nothing to do per layer: saves copy whole blocks after the step, and vLLM keeps those
        blocks until the save is reported done, so the forward pass never waits on the store."""

    def wait_for_save(self) -> None:
        if self._load is not None:  # this step's loads are in; their failures go out with this step
            self._load_errors |= self._load.finish()
            self._load = None
        meta = self._connector_metadata
        if not isinstance(meta, KVStoreConnectorMetadata) or not meta.saves or self._saver is None:
            return
        ready = None
        if self._layout is not None and self._layout.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        bs = self.block_size
        with self._lock:
            for job in meta.saves:
                self._saving.add(job.req_id)  # reported in get_finished even when nothing is left to save
                # A block whose load failed holds no valid KV until vLLM recomputes it, and neither does
                # any block computed on top of it: save only what comes before it. That is this step's
                # failures, and those reported before the scheduler planned the job (asynchronous
                # scheduling plans a step before the last one's output is in). The scheduler plans the
                # rest again once vLLM recomputed it (update_connector_output).
                unseen = max(0, self._failures_reported - job.seen)
                bad = self._load_errors.union(*list(self._failures)[max(0, len(self._failures) - unseen):])
                cut = next((i for i, b in enumerate(job.block_ids) if b in bad), len(job.block_ids))
                if cut:
                    self._saver.submit(SaveJob(job.req_id, job.tokens[:cut * bs], job.block_ids[:cut],
                                               hashes=job.hashes[:cut] if job.hashes else None), ready)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(kv_connector_metadata, KVStoreConnectorMetadata) or self._saver is None:
            return
        for req_id in kv_connector_metadata.preempted:  # its blocks go back to vLLM: stop reading them
            self._saver.drop(req_id)  # queued saves never started: they read nothing
            if not self._saver.wait_for(req_id, _PREEMPT_WAIT_S):
                log.error("kvstore save of preempted %s still running after %.0f s", req_id, _PREEMPT_WAIT_S)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._saver is None:
            return None, None
        with self._lock:
            self._finishing |= finished_req_ids & self._saving
            done = {r for r in self._finishing if not self._saver.pending(r)}
            self._finishing -= done
            self._saving -= done
        return done or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if errors:  # one report: the scheduler counts the outputs that carry invalid blocks
            self._failures.append(errors)
            self._failures_reported += 1
        return errors

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        delta = self.counters.delta()
        return KVStoreConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.close()
        self._reporter.close()
        self.client.close()
        self._lookups.close()
