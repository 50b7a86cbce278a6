"""KVSpec: what a KV tensor is, and which model produced it.

A spec is a frozen value. Its ``fingerprint()`` hashes every field, and the
block keys are seeded with it, so KV of one model (or one weights revision, or
one dtype, or one block size) can never be served to another.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import blake3
import torch

from kvstore.errors import InvalidKV, InvalidSpec

__all__ = ["KVSpec", "DTYPES", "canonical_dtype"]

# Canonical dtype names and their torch types. float32 is for tests and CPU models.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_BY_TORCH = {v: k for k, v in DTYPES.items()}

# Guards against absurd specs from the wire; real models are far below these.
_MAX_LAYERS = 1024
_MAX_HEADS = 1024
_MAX_HEAD_DIM = 4096
_MAX_BLOCK_TOKENS = 65536
_MAX_TEXT = 256
_MODEL_ID = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces


def canonical_dtype(dtype: str | torch.dtype) -> str:
    """Return the canonical name of a supported dtype.

    Args:
        dtype: ``"float16"``, ``"bfloat16"``, ``"float32"`` or the torch dtype.

    Raises:
        InvalidSpec: for any other dtype.
    """
    if isinstance(dtype, torch.dtype):
        name = _BY_TORCH.get(dtype)
    elif isinstance(dtype, str):
        name = dtype if dtype in DTYPES else None
    else:
        name = None
    if name is None:
        raise InvalidSpec(f"dtype must be one of {sorted(DTYPES)} (or the torch dtype), got {dtype!r}")
    return name


def _positive(name: str, value: Any, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpec(f"{name} must be an int, got {type(value).__name__}")
    if not 1 <= value <= limit:
        raise InvalidSpec(f"{name} must be in [1, {limit}], got {value}")
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidSpec(f"{name} must be a non-empty string, got {value!r}")
    if len(value) > _MAX_TEXT or not _MODEL_ID.fullmatch(value):
        raise InvalidSpec(f"{name} must be 1-{_MAX_TEXT} printable ASCII characters without spaces, got {value!r}")
    return value


@dataclass(frozen=True, slots=True, init=False)
class KVSpec:
    """The shape, dtype and identity of a model's KV cache.

    KV tensors are laid out ``[num_layers, 2, num_kv_heads, num_tokens, head_dim]``
    (K then V). The constructor's ``fingerprint`` is the caller's weights
    fingerprint (a revision, a checksum of the weights); it is kept as
    ``weights_fingerprint`` so that ``fingerprint()`` can name the hash of the
    whole spec.
    """

    model_id: str
    """Which model; part of the key seed."""
    weights_fingerprint: str
    """Caller-supplied identity of the weights: "same model name" is not enough."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    """Canonical dtype name; see ``DTYPES``."""
    block_tokens: int
    """Tokens per stored block. Only full blocks are stored."""
    _fp: str = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        model_id: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype = "float16",
        block_tokens: int = 16,
        fingerprint: str | None = None,
        *,
        weights_fingerprint: str | None = None,
    ) -> None:
        if fingerprint is not None and weights_fingerprint is not None and fingerprint != weights_fingerprint:
            raise InvalidSpec("give the weights fingerprint once: fingerprint= or weights_fingerprint=")
        wfp = fingerprint if fingerprint is not None else weights_fingerprint
        if wfp is None:
            raise InvalidSpec(
                "fingerprint is required: a caller-supplied identity of the weights "
                "(e.g. a revision or checksum), so KV never crosses models"
            )
        values = {
            "model_id": _text("model_id", model_id),
            "weights_fingerprint": _text("fingerprint", wfp),
            "num_layers": _positive("num_layers", num_layers, _MAX_LAYERS),
            "num_kv_heads": _positive("num_kv_heads", num_kv_heads, _MAX_HEADS),
            "head_dim": _positive("head_dim", head_dim, _MAX_HEAD_DIM),
            "dtype": canonical_dtype(dtype),
            "block_tokens": _positive("block_tokens", block_tokens, _MAX_BLOCK_TOKENS),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        # Versioned, sorted JSON: stable across processes, Python versions and field order.
        canon = json.dumps({"kvspec": 1, **values}, sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "_fp", blake3.blake3(canon.encode()).hexdigest())

    # -- identity -------------------------------------------------------------

    def fingerprint(self) -> str:
        """Hex blake3 hash of every field; seeds the block keys."""
        return self._fp

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def element_size(self) -> int:
        return DTYPES[self.dtype].itemsize

    # -- shapes ---------------------------------------------------------------

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """The KV tensor shape for ``num_tokens`` tokens."""
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return self.kv_shape(self.block_tokens)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def block_nbytes(self) -> int:
        """Raw bytes of one block's KV."""
        return self.bytes_per_token * self.block_tokens

    def full_blocks(self, num_tokens: int) -> int:
        """How many full blocks ``num_tokens`` tokens make; the tail is not stored."""
        return num_tokens // self.block_tokens

    def empty_kv(self, num_tokens: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
        """An uninitialised KV tensor of this spec."""
        return torch.empty(self.kv_shape(num_tokens), dtype=self.torch_dtype, device=device)

    def validate_kv(self, kv: Any, min_tokens: int = 0) -> torch.Tensor:
        """Check a KV tensor against this spec.

        Args:
            kv: a tensor laid out ``[num_layers, 2, num_kv_heads, num_tokens, head_dim]``.
            min_tokens: the fewest tokens it must cover.

        Returns:
            ``kv`` itself.

        Raises:
            InvalidKV: naming the expected and actual shape or dtype.
        """
        if not isinstance(kv, torch.Tensor):
            raise InvalidKV(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        expected = self.kv_shape(max(min_tokens, 0))
        want = "[{}, 2, {}, >={}, {}]".format(self.num_layers, self.num_kv_heads, min_tokens, self.head_dim)
        shape = tuple(kv.shape)
        if (
            len(shape) != 5
            or shape[0] != expected[0]
            or shape[1] != 2
            or shape[2] != expected[2]
            or shape[4] != expected[4]
            or shape[3] < min_tokens
        ):
            raise InvalidKV(
                f"kv shape {list(shape)} does not match spec {self.model_id!r}: expected {want} "
                "laid out [num_layers, 2, num_kv_heads, num_tokens, head_dim]"
            )
        if kv.dtype != self.torch_dtype:
            raise InvalidKV(f"kv dtype {kv.dtype} does not match spec dtype {self.torch_dtype}")
        return kv

    def replace(self, **changes: Any) -> "KVSpec":
        """A copy with some constructor fields changed (``dataclasses.replace`` cannot)."""
        return KVSpec(**{**self.to_dict(), **changes})

    # -- wire form ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, as the constructor takes them."""
        return {
            "model_id": self.model_id,
            "fingerprint": self.weights_fingerprint,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KVSpec":
        """Build a spec from ``to_dict()`` output; unknown fields are an error.

        Raises:
            InvalidSpec: for a missing, unknown or bad field.
        """
        if not isinstance(data, Mapping):
            raise InvalidSpec(f"spec must be an object, got {type(data).__name__}")
        unknown = sorted(str(k) for k in set(data) - _WIRE_FIELDS)
        if unknown:
            raise InvalidSpec(f"unknown spec field(s) {unknown}; allowed: {sorted(_WIRE_FIELDS)}")
        missing = sorted(_WIRE_REQUIRED - set(data))
        if missing:
            raise InvalidSpec(f"spec is missing field(s) {missing}")
        return cls(**dict(data))


_WIRE_REQUIRED = frozenset({"model_id", "fingerprint", "num_layers", "num_kv_heads", "head_dim"})
_WIRE_FIELDS = _WIRE_REQUIRED | {"dtype", "block_tokens"}
