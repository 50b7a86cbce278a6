"""transformers caches <-> kvstore's KV tensor, so ``get_kv`` can resume generation.

kvstore's layout is ``[num_layers, 2, num_kv_heads, num_tokens, head_dim]``
(K then V): each layer's ``[batch=1, heads, tokens, head_dim]`` key and value
states, stacked. ::

    spec = spec_for(model, fingerprint="weights-rev-1")
    out = model(prefix_ids, use_cache=True)
    client.put_kv(spec, prefix, kv_from_cache(out_cache(out)))
    ...
    kv, n = client.get_kv(spec, prompt)
    cache = cache_from_kv(kv, model.config)
    out = model(prompt_ids[:, n:], **cache_kwargs(model, cache))

Works with ``DynamicCache`` (transformers 4.4x and 5.x) and with the legacy
tuple-of-(key, value) form. Only full-attention caches with batch size 1 fit
the store: a sliding-window layer keeps fewer tokens than the others and is
refused.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

from kvstore.errors import InvalidKV, InvalidSpec
from kvstore.spec import KVSpec

__all__ = ["spec_for", "kv_from_cache", "cache_from_kv", "cache_kwargs", "out_cache", "measure_prefill_rate"]


def _config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    get_text = getattr(config, "get_text_config", None)
    return get_text(decoder=True) if callable(get_text) else config


def spec_for(model_or_config: Any, fingerprint: str, *, block_tokens: int = 16, dtype: Any = None,
             model_id: str | None = None) -> KVSpec:
    """The ``KVSpec`` of a transformers model's KV cache.

    Args:
        model_or_config: a ``PreTrainedModel`` or its config.
        fingerprint: the caller's identity of the weights (a revision, a checksum).
        block_tokens: tokens per stored block.
        dtype: KV dtype; default the model's (or the config's ``torch_dtype``, else float32).
        model_id: default ``config._name_or_path`` or ``config.model_type``.

    Raises:
        InvalidSpec: the config lacks the attention shape.
    """
    config = _config(model_or_config)
    try:
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    except (AttributeError, TypeError) as exc:
        raise InvalidSpec(f"the model config has no attention shape: {exc}") from exc
    if dtype is None:
        dtype = getattr(model_or_config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    name = model_id or getattr(config, "_name_or_path", None) or getattr(config, "model_type", None) or "hf-model"
    return KVSpec(str(name).replace(" ", "_")[:256], layers, kv_heads, head_dim, dtype, block_tokens,
                  fingerprint=fingerprint)


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56: Cache.layers[i].keys / .values
        out = []
        for i, layer in enumerate(cache.layers):
            if getattr(layer, "is_sliding", False):
                raise InvalidKV(f"cache layer {i} is a sliding-window layer; only full-attention caches fit the store")
            out.append((layer.keys, layer.values))
        return out
    if hasattr(cache, "key_cache"):  # 4.4x DynamicCache
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (tuple, list)):  # the legacy form
        return [(layer[0], layer[1]) for layer in cache]
    raise InvalidKV(f"not a transformers cache: {type(cache).__name__}")


def kv_from_cache(cache: Any, spec: KVSpec | None = None) -> torch.Tensor:
    """``[L, 2, H, T, D]`` from a cache of batch size 1 (a new tensor, detached).

    Raises:
        InvalidKV: batch size other than 1, layers of different lengths, or a mismatch with ``spec``.
    """
    layers = _layers(cache)
    if not layers:
        raise InvalidKV("the cache is empty")
    shapes = {tuple(k.shape) for k, _ in layers} | {tuple(v.shape) for _, v in layers}
    if len(shapes) != 1:
        raise InvalidKV(f"cache layers differ in shape: {sorted(shapes)}")
    (shape,) = shapes
    if len(shape) != 4 or shape[0] != 1:
        raise InvalidKV(f"cache tensors must be [batch=1, heads, tokens, head_dim], got {list(shape)}")
    kv = torch.stack([torch.stack((k[0], v[0])) for k, v in layers]).detach()
    if spec is not None:
        spec.validate_kv(kv)
    return kv


def cache_from_kv(kv: torch.Tensor, config: Any = None) -> Any:
    """A ``DynamicCache`` holding ``kv`` (``[L, 2, H, T, D]``) as batch size 1.

    Args:
        config: the model config, so the cache builds the right layer types (optional).
    """
    from transformers import DynamicCache

    if kv.dim() != 5 or kv.shape[1] != 2:
        raise InvalidKV(f"kv must be [num_layers, 2, num_kv_heads, num_tokens, head_dim], got {list(kv.shape)}")
    data = [(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(kv.shape[0])]
    params = inspect.signature(DynamicCache.__init__).parameters
    if "ddp_cache_data" in params:
        return DynamicCache(ddp_cache_data=data, **({"config": config} if "config" in params and config else {}))
    return DynamicCache.from_legacy_cache(tuple(data))  # transformers < 4.56


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword a model's ``forward`` takes its cache by: ``cache`` (5.x) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def out_cache(output: Any) -> Any:
    """The cache of a model output, whatever this transformers version names it."""
    for name in ("cache", "past_key_values"):
        cache = getattr(output, name, None) if name in getattr(output, "keys", lambda: ())() else None
        if cache is not None:
            return cache
    raise InvalidKV("the model output carries no cache (call the model with use_cache=True)")


def measure_prefill_rate(model: Any, tokens: int = 512, *, repeats: int = 2, vocab: int | None = None) -> float:
    """The model's prefill rate here, in tokens per second: what recomputing a prefix costs.

    Hand it to ``KVClient.set_prefill_rate(spec, rate)`` so the planner can weigh fetching
    against recomputing. Times a prefill of ``tokens`` random ids, best of ``repeats`` after
    one untimed run (a first call pays for allocations), with gradients off.

    Raises:
        InvalidSpec: ``tokens`` or ``repeats`` is not a positive integer, or the model has no
            vocabulary size or no parameters.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise InvalidSpec(f"tokens must be a positive integer, got {tokens!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats <= 0:
        raise InvalidSpec(f"repeats must be a positive integer, got {repeats!r}")
    size = vocab or getattr(_config(model), "vocab_size", None)
    if not size:
        raise InvalidSpec("the model config has no vocab_size; pass vocab=")
    param = next(iter(model.parameters()), None)
    if param is None:
        raise InvalidSpec("the model has no parameters to place its input by")
    device = param.device
    ids = torch.randint(0, int(size), (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    best = float("inf")
    with torch.inference_mode():
        model(ids)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the untimed run's GPU work must not land in the first timing
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
    return tokens / best
