"""One agent of ``kvstore demo agents``: a seeded random Llama, its prompt, its TTFT with and without the store.

Every agent process builds the same model from the same seed, so the weights
are bit-identical across processes; their digest is the spec's weights
fingerprint, so KV computed by other weights could never be served here. The
prompt is the shared context (the same seeded token ids in every agent) and
then the agent's own role text (token ids seeded by the role's name): no
tokenizer is needed, and the store keys on token ids anyway.

TTFT is the time from having the prompt to having the logits of the first
generated token:

- without the store: a full prefill of the prompt (the best of ``repeats``);
- with the store: ``get_kv`` of the longest stored prefix, a cache rebuilt
  from it, and a prefill of only the remaining tokens (measured once: a second
  get would be served from the SDK's handle cache and flatter the store).

The agent then puts the KV of its whole prompt, after the clock, so the agents
after it find the shared context.

``run_agent`` is one agent of the default scenario, start to end. ``AgentSession`` is one
agent of the hand-off scenario: it builds the model once and then takes turns, one per
variant, each in the variant's namespace, reporting where its prefix was when it arrived.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch

__all__ = ["DemoConfig", "ROLES", "build_model", "token_ids", "prompt_tokens", "ttft_with", "run_agent", "AgentSession"]

ROLES: tuple[tuple[str, int], ...] = (("planner", 24), ("coder", 40), ("reviewer", 32))
"""Each agent's role and the length of its role text, tokens (tens, after the shared context)."""


@dataclass(slots=True)
class DemoConfig:
    """The model and prompt every agent builds; travels to the agent processes as JSON."""

    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1376
    vocab: int = 32000
    context_tokens: int = 1536
    """Shared context (system prompt plus task) every agent's prompt starts with."""
    block_tokens: int = 16
    seed: int = 0
    """Seeds the weights and the shared context; the same in every process."""
    torch_threads: int = 2
    repeats: int = 2
    """Full prefills timed per agent for the no-store TTFT; the best counts (the conservative pick)."""

    def __post_init__(self) -> None:
        if not self.block_tokens <= self.context_tokens <= 16384:
            raise ValueError(f"context_tokens must be in [{self.block_tokens}, 16384], got {self.context_tokens}")
        if self.hidden % self.heads or self.heads % self.kv_heads or self.repeats < 1 or self.layers < 1:
            raise ValueError(f"inconsistent demo model: {asdict(self)}")

    @classmethod
    def quick(cls, **overrides: Any) -> "DemoConfig":
        """A smaller model and context (a smoke run; the speed-up is smaller, ~3-10x on 2 cores)."""
        return cls(**{"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 688, "vocab": 8000,
                      "context_tokens": 768, "repeats": 2, **overrides})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DemoConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def build_model(cfg: DemoConfig) -> tuple[Any, str]:
    """The seeded random ``LlamaForCausalLM`` (eval mode) and the digest of its weights.

    Raises:
        ImportError: transformers is not installed.
    """
    import blake3
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                         num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                         num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.context_tokens + 256)
    model = LlamaForCausalLM(config).eval()
    digest = blake3.blake3()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return model, digest.hexdigest()


def token_ids(cfg: DemoConfig, n: int, seed: int) -> list[int]:
    """``n`` token ids drawn from the model's vocabulary by ``seed`` (the same in every process)."""
    return torch.randint(0, cfg.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompt_tokens(cfg: DemoConfig, role: str, role_tokens: int) -> list[int]:
    """The shared context's token ids, then ``role``'s (seeded by its name, so stable across runs)."""
    return token_ids(cfg, cfg.context_tokens, cfg.seed + 1) + token_ids(cfg, role_tokens, zlib.crc32(role.encode()))


def _medium(client: Any) -> tuple[str | None, str | None]:
    """The medium of the client's last transfer and why (the planner's choice and reason when it has one)."""
    # Before the SDK had a planner, the medium the last call used was all it said.
    decision = getattr(client, "last_decision", None)
    if decision is not None:
        return decision.choice, getattr(decision, "reason", None)
    return client.stats.last_medium, None


def _ttft_without(model: Any, ids: torch.Tensor, repeats: int) -> tuple[float, list[float], torch.Tensor]:
    """Best-of-``repeats`` full prefill time, every sample, and the last position's logits."""
    model(ids)  # a full untimed prefill first: first-call allocations would weigh on one clock only
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits = model(ids).logits[0, -1]
        samples.append(time.perf_counter() - t0)
    return min(samples), samples, logits


def ttft_with(client: Any, model: Any, spec: Any, prompt: list[int], ids: torch.Tensor) -> dict[str, Any]:
    """``get_kv``, a cache rebuilt from it, a prefill of the rest: the time, and what it left.

    Returns:
        ``ttft_s`` (the whole), ``get_s`` (the fetch alone), ``hit`` and ``reuse`` (tokens found
        and reused), ``out`` (the model's output) and ``logits`` (the first token's).
    """
    from kvstore.integrations.hf import cache_from_kv, cache_kwargs

    t0 = time.perf_counter()
    kv, hit = client.get_kv(spec, prompt)
    get_s = time.perf_counter() - t0
    reuse = min(hit, len(prompt) - 1)  # the model must see one new token to give next-token logits
    if reuse:
        cache = cache_from_kv(kv[:, :, :, :reuse], model.config)
        out = model(ids[:, reuse:], use_cache=True, **cache_kwargs(model, cache))
    else:
        out = model(ids, use_cache=True)
    logits = out.logits[0, -1]
    return {"ttft_s": time.perf_counter() - t0, "get_s": get_s, "hit": hit, "reuse": reuse, "out": out,
            "logits": logits}




def run_agent(cfg: DemoConfig, role: str, role_tokens: int, url: str, namespace: str,
              emit: Callable[[str], None]) -> dict[str, Any]:
    """Measure one agent's TTFT without and with the store, then put its prompt's KV.

    Args:
        url: the ``kvstore serve`` to use.
        emit: receives a progress line per step.

    Returns:
        A JSON-able dict: token counts, TTFTs (seconds), medium, first tokens, put result.

    Raises:
        ImportError: transformers is not installed.
        KVStoreError subclasses: the store refused a call (``ConnectionFailed``, ``TierFull``...).
    """
    from client_sdk import KVClient
    from kvstore.integrations.hf import kv_from_cache, out_cache, spec_for

    torch.set_num_threads(cfg.torch_threads)
    t0 = time.perf_counter()
    model, digest = build_model(cfg)
    build_s = time.perf_counter() - t0
    spec = spec_for(model, fingerprint=digest[:32], block_tokens=cfg.block_tokens, model_id="kvstore-demo-agents")
    prompt = prompt_tokens(cfg, role, role_tokens)
    ids = torch.tensor([prompt])
    emit(f"model ready in {build_s:.1f} s (weights {digest[:12]}), prompt {len(prompt)} tokens")
    with torch.inference_mode(), KVClient(url, namespace=namespace) as client:
        without_s, samples, logits_without = _ttft_without(model, ids, cfg.repeats)
        rate = len(prompt) / without_s
        emit(f"full prefill {without_s:.3f} s ({rate:,.0f} tokens/s, best of {cfg.repeats})")
        if hasattr(client, "set_prefill_rate"):
            client.set_prefill_rate(spec, rate)
        lookup_tokens = client.lookup(spec, prompt)  # also opens the connection, as a running agent has it
        w = ttft_with(client, model, spec, prompt, ids)
        medium, why = _medium(client)
        first_without, first_with = int(logits_without.argmax()), int(w["logits"].argmax())
        emit(f"get_kv hit {w['hit']} tokens via {medium} in {1e3 * w['get_s']:.1f} ms, TTFT {w['ttft_s']:.3f} s "
             f"(without store {without_s:.3f} s), first token {first_with} "
             f"{'==' if first_with == first_without else '!='} {first_without}")
        t0 = time.perf_counter()
        stored = client.put_kv(spec, prompt, kv_from_cache(out_cache(w["out"]), spec))
        put_s = time.perf_counter() - t0
        emit(f"put_kv {stored} tokens via {_medium(client)[0]} in {1e3 * put_s:.1f} ms")
    return {
        "role": role, "pid": os.getpid(), "prompt_tokens": len(prompt), "role_tokens": role_tokens,
        "lookup_tokens": lookup_tokens, "hit_tokens": w["hit"], "reused_tokens": w["reuse"], "medium": medium,
        "medium_reason": why, "ttft_without_s": without_s, "ttft_without_samples_s": samples,
        "ttft_with_s": w["ttft_s"], "get_s": w["get_s"], "speedup": without_s / w["ttft_s"],
        "first_token_without": first_without, "first_token_with": first_with,
        "first_token_match": first_with == first_without,
        "max_logit_diff": float((w["logits"] - logits_without).abs().max()),
        "prefill_rate_tok_s": rate, "build_s": build_s, "put_tokens": stored, "put_s": put_s,
        "weights_digest": digest, "kv_bytes_per_token": spec.bytes_per_token,
    }


class AgentSession:
    """One agent of the demo's hand-off scenario, alive across its turns (one per variant).

    The model is built and the TTFT without the store measured once. Each of ``namespaces`` (a
    variant of the scenario) gets its own client, opened and warmed up here (the arena mapped,
    the cached path run once), so that no variant pays for them. The clients keep their medium
    fixed (``plan=False``: shm, and blocks not in the arena over HTTP in one batch): the SDK's
    planner would learn from one variant's slow gets and switch medium in the next.

    Raises:
        ImportError: transformers is not installed.
        KVStoreError subclasses: the store refused a call.
    """

    def __init__(self, cfg: DemoConfig, role: str, role_tokens: int, url: str, namespaces: list[str],
                 emit: Callable[[str], None]) -> None:
        from client_sdk import KVClient
        from kvstore.integrations.hf import spec_for

        torch.set_num_threads(cfg.torch_threads)
        t0 = time.perf_counter()
        self.cfg, self.role = cfg, role
        self.model, self.digest = build_model(cfg)
        self.build_s = time.perf_counter() - t0
        self.spec = spec_for(self.model, fingerprint=self.digest[:32], block_tokens=cfg.block_tokens,
                             model_id="kvstore-demo-agents")
        self.prompt = prompt_tokens(cfg, role, role_tokens)
        self.ids = torch.tensor([self.prompt])
        with torch.inference_mode():
            self.without_s, self.without_samples, self.logits_without = _ttft_without(self.model, self.ids,
                                                                                      cfg.repeats)
        self.clients = {ns: KVClient(url, namespace=ns, agent=role, plan=False) for ns in namespaces}
        for client in self.clients.values():
            self._warm(client)
        emit(f"ready in {time.perf_counter() - t0:.1f} s (weights {self.digest[:12]}), prompt {len(self.prompt)} "
             f"tokens, full prefill {self.without_s:.3f} s")

    def _warm(self, client: Any) -> None:
        """A miss, then a get of two blocks of the agent's own and a prefill from them: the arena
        is mapped, the connection open, both paths' first-call costs paid."""
        bt = self.spec.block_tokens
        warm = token_ids(self.cfg, 2 * bt + 8, zlib.crc32(f"warm-{self.role}".encode()))
        with torch.inference_mode():
            ttft_with(client, self.model, self.spec, warm, torch.tensor([warm]))
            client.put_kv(self.spec, warm, torch.zeros(self.spec.kv_shape(2 * bt), dtype=self.spec.torch_dtype))
            ttft_with(client, self.model, self.spec, warm, torch.tensor([warm]))

    def describe(self) -> dict[str, Any]:
        return {"role": self.role, "pid": os.getpid(), "prompt_tokens": len(self.prompt), "spec": self.spec.to_dict(),
                "weights_digest": self.digest, "build_s": self.build_s, "ttft_without_s": self.without_s,
                "ttft_without_samples_s": self.without_samples,
                "first_token_without": int(self.logits_without.argmax())}

    def turn(self, namespace: str, *, release: bool = False, retain_s: float | None = None) -> dict[str, Any]:
        """The agent's turn: where its prefix is (a lookup, untimed), its TTFT with the store, its put.

        Args:
            release: end the retention of the prefix it just read (the previous agent's), first.
            retain_s: retain its whole prompt this long after its put (for the next agent).

        Returns:
            A JSON-able dict: ``tiers_at_arrival`` (blocks per tier), ``medium`` and
            ``blocks_over_http`` of the get, TTFTs, first tokens, ``get_at`` (``perf_counter``,
            one clock for every process here), what was released, stored and retained.
        """
        from kvstore.integrations.hf import kv_from_cache, out_cache

        client = self.clients[namespace]
        spec, prompt = self.spec, self.prompt
        with torch.inference_mode():
            found = client.lookup_blocks(spec, prompt)["blocks"]
            over_http = client.stats.shm_blocks_fetched_over_http
            get_at = time.perf_counter()
            w = ttft_with(client, self.model, spec, prompt, self.ids)
            over_http = client.stats.shm_blocks_fetched_over_http - over_http
            medium = client.stats.last_medium
            released = client.release(spec, prompt) if release else None
            stored = client.put_kv(spec, prompt, kv_from_cache(out_cache(w["out"]), spec))
            retained = client.retain(spec, prompt, ttl_s=retain_s) if retain_s else None
        first_with, first_without = int(w["logits"].argmax()), int(self.logits_without.argmax())
        return {
            "role": self.role, "namespace": namespace, "prompt_tokens": len(prompt),
            "tiers_at_arrival": {t: sum(b["tier"] == t for b in found) for t in sorted({b["tier"] for b in found})},
            "hit_tokens": w["hit"], "reused_tokens": w["reuse"], "medium": medium, "blocks_over_http": over_http,
            "get_at": get_at, "get_s": w["get_s"], "ttft_with_s": w["ttft_s"], "ttft_without_s": self.without_s,
            "speedup": self.without_s / w["ttft_s"], "first_token_with": first_with,
            "first_token_without": first_without, "first_token_match": first_with == first_without,
            "max_logit_diff": float((w["logits"] - self.logits_without).abs().max()),
            "released_blocks": released, "put_tokens": stored,
            "retained": None if retained is None else {k: retained[k] for k in ("blocks", "bytes", "expires_in_s")},
        }

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
