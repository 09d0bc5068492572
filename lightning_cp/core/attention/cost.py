"""The communication cost of each attention mode, exactly as the implementation sends it, and the mode it suggests.

``bytes_sent_per_layer`` is what one rank sends to other ranks for one attention layer, forward plus backward (the
tests count the real collectives and check them against it). All modes scale linearly in the tokens and the head
dimension, so for equal element sizes the cheapest mode depends only on cp and the head counts, and
``choose_attention_mode`` picks it (under bf16 the ring's float32 dK/dV make ring and hybrid a little dearer than it
assumes). All-gather streams the sources (each rank's K/V broadcast in turn, in the forward and again in the
backward, dK/dV pieces reduced onto their owners), so neither mode holds every rank's K/V at once.
"""

from __future__ import annotations

from lightning_cp.core.attention.head_parallel import kv_replication


def bytes_sent_per_layer(
    mode: str,
    cp_size: int,
    local_rows: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    element_size: int,
    gradient_element_size: int | None = None,
    ulysses_size: int | None = None,
    finite_flags: bool = False,
) -> float:
    """Bytes one rank sends for one attention layer's forward and backward.

    ``local_rows``: the rank's query rows (tokens x batch rows) in the layout the mode takes; ``gradient_element_size``:
    the size of the ring's accumulated dK/dV (float32 for half precisions; default ``element_size``);
    ``finite_flags``: the kernel needs finite inputs (CPU flash, CUDA SDPA), so each forward K/V message carries one
    more element, the owner's finite flag (a few bytes per layer, which the mode choice leaves out).
    """
    gradient_element_size = gradient_element_size or element_size
    row = head_dim * element_size
    flags = element_size if finite_flags else 0
    if mode == "allgather":  # K/V broadcast from each source in the forward and again in the backward, dK/dV
        return 6 * (cp_size - 1) * local_rows * kv_heads * row + (cp_size - 1) * flags  # pieces reduced to owners
    if mode == "ring":
        kv_elements = local_rows * kv_heads * head_dim
        return _ring_bytes(cp_size, kv_elements, element_size, gradient_element_size) + (cp_size - 1) * flags
    ulysses = cp_size if mode == "ulysses" else ulysses_size
    if mode not in ("ulysses", "hybrid") or ulysses is None:
        raise ValueError(f"mode={mode!r} with ulysses_size={ulysses_size!r}: no cost model")
    replicated_kv = kv_heads * kv_replication(heads, kv_heads, ulysses, mode)
    exchange = 2 * (ulysses - 1) / ulysses * local_rows * (2 * heads + 2 * replicated_kv) * row
    if mode == "ulysses":
        return exchange
    ring = cp_size // ulysses
    kv_elements = local_rows * replicated_kv * head_dim
    return exchange + _ring_bytes(ring, kv_elements, element_size, gradient_element_size) + (ring - 1) * flags


def _ring_bytes(ranks: int, kv_elements: int, element_size: int, gradient_element_size: int) -> float:
    """K/V passed ``ranks - 1`` times forward and backward, dK/dV ``ranks`` times backward."""
    return 2 * kv_elements * ((2 * ranks - 2) * element_size + ranks * gradient_element_size)


def choose_attention_mode(cp_size: int, heads: int, kv_heads: int) -> tuple[str, int | None]:
    """Return ``(mode, ulysses_size)`` that sends the fewest bytes per layer; on a tie the one with fewer moving parts
    (all-gather, then Ulysses, then hybrid)."""
    candidates: list[tuple[float, int, str, int | None]] = [
        (bytes_sent_per_layer("allgather", cp_size, 1, heads, kv_heads, 1, 1), 0, "allgather", None)
    ]
    if cp_size > 1 and heads % cp_size == 0:
        candidates.append((bytes_sent_per_layer("ulysses", cp_size, 1, heads, kv_heads, 1, 1), 1, "ulysses", None))
    for ulysses in range(2, cp_size):
        if cp_size % ulysses == 0 and heads % ulysses == 0:
            cost = bytes_sent_per_layer("hybrid", cp_size, 1, heads, kv_heads, 1, 1, ulysses_size=ulysses)
            candidates.append((cost, 2, "hybrid", ulysses))
    _, _, mode, ulysses = min(candidates)
    return mode, ulysses


def model_head_counts(model: object) -> tuple[int, int] | None:
    """Find ``(query heads, key/value heads)`` of a model's attention: the first module (the model itself, or a
    wrapped Hugging Face model) with a ``config`` naming them, or with ``num_heads`` and ``num_kv_heads``; ``None``
    when there is neither."""
    modules = model.modules() if hasattr(model, "modules") else (model,)
    for module in modules:
        config = getattr(module, "config", None)
        if isinstance(getattr(config, "num_attention_heads", None), int):
            heads = config.num_attention_heads
            return heads, getattr(config, "num_key_value_heads", None) or heads
        heads = getattr(module, "num_heads", None)
        kv_heads = getattr(module, "num_kv_heads", None) or getattr(module, "num_key_value_heads", None)
        if isinstance(heads, int) and isinstance(kv_heads, int):
            return heads, kv_heads
    return None
