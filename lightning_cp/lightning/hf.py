"""Hugging Face causal LMs under ``cp_zigzag``, unmodified: the ``"lightning_cp"`` attention and ``HFCausalLM``.

Importing this module registers ``"lightning_cp"`` with ``transformers.AttentionInterface`` (and a mask function
that builds no mask: documents come from the step). Under a step the attention maps Hugging Face's ``[B, H, S, D]``
to ``cp_attention`` and raises on what it cannot do exactly; outside one, attention and mask are Hugging Face's
``sdpa``. Needs ``pip install lightning_cp[hf]``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from typing_extensions import override

from lightning_cp.core import comm
from lightning_cp.core.functional import (
    cp_attention,
    cp_causal_conv1d,
    cp_gated_delta_rule,
    cp_selective_scan,
    cp_ssd_scan,
)
from lightning_cp.core.loss import CPLoss, cp_chunked_cross_entropy
from lightning_cp.core.step import activated, active_step
from lightning_cp.lightning.module import CausalLMModule

ATTENTION_NAME = "lightning_cp"


@comm.eager_under_compile
def lightning_cp_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face attention signature over ``cp_attention``: ``[B, H, S, D]`` in, ``[B, S, H, D]`` out.

    A ``sliding_window`` is exact while no document is longer than it (it then hides nothing): Mistral-style configs
    train on such documents as they are. Outside a step (generation, plain inference after training) it is Hugging
    Face's own ``sdpa``, masks and KV cache included."""
    if active_step() is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    window, longest = kwargs.get("sliding_window"), _longest_document(query.shape[2])
    unsupported = {
        "an attention_mask (padding or custom 4-D masks; pack documents instead)": attention_mask is not None,
        f"dropout={dropout}": bool(dropout) and module.training,
        f"softcap={kwargs.get('softcap')}": kwargs.get("softcap") is not None,
        f"sliding_window={window} over a document of {longest} tokens": window is not None and longest > window,
        "attention sinks": kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None,
    }
    problems = [what for what, present in unsupported.items() if present]
    if problems:
        raise ValueError(
            f"attention_implementation='{ATTENTION_NAME}' cannot compute {', '.join(problems)} exactly "
            f"({type(module).__name__}); turn it off in the model config"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = cp_attention(*(x.transpose(1, 2) for x in (query, key, value)), causal=causal, softmax_scale=scaling)
    return out, None


def _longest_document(local_length: int) -> int:
    """The token count of the step's longest document (without a step: the ``local_length`` tokens of the row)."""
    step = active_step()
    if step is None:
        return local_length
    packed = step.contiguous_packed_seq_params
    return packed.max_seqlen_q if packed is not None else step.sequence_length


def _no_mask(
    *args: Any, attention_mask: torch.Tensor | None = None, local_size: int | None = None, **kwargs: Any
) -> None:
    """Mask of ``"lightning_cp"`` under a step: none (documents come from the step); padding masks are an error, and so
    is a local window (a sliding window only the mask carries, chunked attention) that a document outgrows."""
    _refuse_padding(attention_mask)
    if not local_size or not _has_local_layers(kwargs.get("config")):
        return  # no window (Qwen2-MoE's 0), or a sliding mask the model builds but no layer of it uses
    if (longest := _longest_document(kwargs.get("kv_length", 0))) > local_size:
        raise ValueError(
            f"attention_implementation='{ATTENTION_NAME}' cannot compute a local window of {local_size} tokens "
            f"(sliding_window or attention_chunk_size) over a document of {longest} tokens exactly; turn it off in "
            "the model config or keep documents within it"
        )


def _refuse_padding(attention_mask: torch.Tensor | None) -> None:
    """Raise when a mask under a step masks tokens out: documents come from the step, padding is not kept."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask masks tokens out (padding); pack documents into one row instead")


def _has_local_layers(config: Any) -> bool:
    """Whether a layer of ``config`` attends within a local window (without a config: assume so)."""
    if config is None:
        return True
    text = config.get_text_config()
    if getattr(text, "use_sliding_window", True) is False:
        return False
    layer_types = getattr(text, "layer_types", None)
    return not layer_types or any(kind in ("sliding_attention", "chunked_attention") for kind in layer_types)


def _rope_length_limit(config: Any) -> tuple[str, int] | None:
    """The rotary type and length past which a model rescales its rotary frequencies by the longest position of the
    row it is given (``longrope``'s long factors, ``dynamic`` NTK), or None."""
    text = config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind == "longrope":
        limit = rope.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings", None)
        return kind, int(limit or text.max_position_embeddings)
    if kind == "dynamic":
        return kind, int(text.max_position_embeddings)
    return None


@comm.eager_under_compile
def _step_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Mask function of ``"lightning_cp"``: none under a step (``_no_mask``), Hugging Face's ``sdpa`` mask outside."""
    return _no_mask(*args, **kwargs) if active_step() is not None else sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTENTION_NAME, lightning_cp_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _step_mask)

_TOKEN_WISE_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "moe", "mlp"}
)
"""Layer types of Hugging Face configs whose token mixing is attention alone (or none)."""


_SHORT_CONVOLUTIONS = frozenset({"Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"})
"""Hugging Face's short-convolution mixers (the LFM2 family's ``conv`` layers): an input projection to ``B, C, x``, a
depthwise causal convolution of ``B * x``, ``C`` times that, an output projection."""


class _ShortConvolutionUnderCP:
    """The forward of a short-convolution mixer: under a step, its convolution per document across the shards
    (``cp_causal_conv1d``); outside one, the model's own (generation, its cache and masks), or the forward the
    instance had before (a hook's, such as accelerate's device placement). An instance forward rather than a routed
    module function (``_RoutedUnderCP``): LFM2's mixers call ``causal_conv1d_forward`` only in recent transformers
    releases (5.0's run their own ``slow_forward``), and this works with every 5.x release."""

    def __init__(self, mixer: torch.nn.Module, instance_forward: Callable[..., Any] | None) -> None:
        self.mixer = mixer
        self.instance_forward = instance_forward

    def __call__(
        self, hidden_states: torch.Tensor, *args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Mix ``hidden_states`` ``[B, S_local, hidden]`` along the sequence."""
        mixer = self.mixer
        if active_step() is None:
            forward = self.instance_forward or functools.partial(type(mixer).forward, mixer)
            return forward(hidden_states, *args, attention_mask=attention_mask, **kwargs)
        _refuse_padding(attention_mask)
        gate_in, gate_out, values = mixer.in_proj(hidden_states).chunk(3, dim=-1)
        convolution = mixer.conv
        mixed = cp_causal_conv1d(gate_in * values, convolution.weight.squeeze(1), convolution.bias)
        return mixer.out_proj(gate_out * mixed)


def _use_cp_short_convolutions(model: torch.nn.Module) -> None:
    """Give every short-convolution mixer of ``model`` the forward that is exact under a step (weights unchanged)."""
    for module in model.modules():
        instance_forward = module.__dict__.get("forward")
        if comm.original_class_name(module) in _SHORT_CONVOLUTIONS and not isinstance(
            instance_forward, _ShortConvolutionUnderCP
        ):
            module.forward = _ShortConvolutionUnderCP(module, instance_forward)


class _RoutedUnderCP:
    """A function of a Hugging Face modeling module that, under a step, is lightning_cp's exact version (per document,
    across the shards); outside one, the module's own (generation with its cache, kernels)."""

    def __init__(self, original: Callable[..., Any], under_step: Callable[..., Any]) -> None:
        self.original = original
        self.under_step = under_step
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.original(*args, **kwargs) if active_step() is None else self.under_step(*args, **kwargs)


def _no_fused_kernel(*args: Any, **kwargs: Any) -> None:
    """A Mamba or Mamba2 mixer's fused convolution-and-scan kernel under a step: none, so the mixer calls the two one
    by one."""
    return None


def _causal_convolution(
    conv1d: torch.nn.Conv1d,
    hidden_states: torch.Tensor,
    cache: Any,
    layer_idx: int,
    activation: str | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """A mixer's convolution of ``[b, channels, S_local]`` under a step (``causal_conv1d_forward``):
    ``cp_causal_conv1d``, then the activation."""
    _refuse_cache(cache)
    weight = conv1d.weight.squeeze(1)  # the convolution and its activation in the weight's dtype, as the module's own
    output = cp_causal_conv1d(hidden_states.transpose(1, 2).to(weight.dtype), weight, conv1d.bias)
    output = output if activation is None else ACT2FN[activation](output)
    return output.transpose(1, 2).to(hidden_states.dtype)


def _mamba2_scan(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dt: torch.Tensor,
    cache: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """A Mamba2 mixer's selective scan under a step: its step sizes and decays as Hugging Face's reference scan makes
    them, ``cp_ssd_scan``, and the ``D`` skip; ``[b, S_local, heads * head_dim]`` in at least float32."""
    _refuse_cache(cache)
    rows, length, _ = hidden_states.shape
    dt = F.softplus(dt + module.dt_bias.to(dt.dtype)).clamp(*module.time_step_limit)
    x = hidden_states.view(rows, length, module.num_heads, module.head_dim)
    B, C = (tensor.view(rows, length, module.n_groups, module.ssm_state_size) for tensor in (B, C))
    y = cp_ssd_scan(x, dt, -torch.exp(module.A_log.float()), B, C, chunk_size=module.chunk_size)
    return (y + module.D[:, None] * x.to(y.dtype)).reshape(rows, length, -1)


def _mamba_scan(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    time_step: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    gate: torch.Tensor,
    cache: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """A Mamba mixer's selective scan under a step (Mamba, Falcon Mamba, Jamba): its step sizes and decays as Hugging
    Face's reference scan makes them, ``cp_selective_scan``, the ``D`` skip and the gate; ``[b, channels, S_local]``
    in at least float32."""
    _refuse_cache(cache)
    bias = module.dt_proj.bias
    time_step = time_step if bias is None else time_step + bias.to(time_step.dtype)[:, None]
    x, dt, gate = (tensor.transpose(1, 2) for tensor in (hidden_states, F.softplus(time_step), gate))
    y = cp_selective_scan(x, dt, -torch.exp(module.A_log.float()), B, C)
    return ((y + module.D * x.to(y.dtype)) * F.silu(gate.to(y.dtype))).transpose(1, 2)


def _gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A Gated DeltaNet or Kimi delta attention layer's chunked rule under a step: ``cp_gated_delta_rule`` with the
    preparation of Hugging Face's reference (query and key per key head, L2-normalised if asked, queries scaled by
    ``dk ** -0.5``; documents come from the step, not from ``cu_seqlens``) in the library's own chunks (Hugging Face's
    ``chunk_size`` sizes its kernel's); the output in the query's dtype, and no state."""
    _refuse_cache(initial_state, output_final_state)
    output = cp_gated_delta_rule(query, key, value, g, beta, l2_normalize_qk=use_qk_l2norm_in_kernel)
    return output.to(query.dtype), None


def _refuse_cache(*states: Any) -> None:
    """Raise when a mixer under a step is given a cache or a state, or asked for one: a step trains on whole
    documents, not token by token."""
    if any(state is not None and state is not False for state in states):
        raise ValueError("a cache under a CP step: pass use_cache=False (steps train on whole documents)")


_MAMBA2_ROUTES = {
    "mamba2_split_conv1d_scan_combined": _no_fused_kernel,
    "causal_conv1d_forward": _causal_convolution,
    "mamba2_scan_forward": _mamba2_scan,
}
_MAMBA_ROUTES = {"causal_conv1d_forward": _causal_convolution, "mamba_scan_forward": _mamba_scan}
_DELTA_RULE_ROUTES = {"causal_conv1d_forward": _causal_convolution, "torch_chunk_gated_delta_rule": _gated_delta_rule}
_KIMI_DELTA_ROUTES = {"causal_conv1d_forward": _causal_convolution, "chunk_kimi_delta_attention": _gated_delta_rule}
_ROUTED_MIXERS = {
    **dict.fromkeys(
        (
            "Mamba2Mixer",
            "BambaMixer",
            "GraniteMoeHybridMambaLayer",
            "NemotronHMamba2Mixer",
            "FalconH1Mixer",
            "Zamba2MambaMixer",
        ),
        _MAMBA2_ROUTES,
    ),
    "MambaMixer": {"mamba_inner_fn": _no_fused_kernel, **_MAMBA_ROUTES},
    **dict.fromkeys(("FalconMambaMixer", "JambaMambaMixer"), _MAMBA_ROUTES),
    **dict.fromkeys(
        (
            "Qwen3NextGatedDeltaNet",
            "Qwen3_5GatedDeltaNet",
            "Qwen3_5MoeGatedDeltaNet",
            "OlmoHybridGatedDeltaNet",
            "LaraMiniGatedDeltaNet",
        ),
        _DELTA_RULE_ROUTES,
    ),
    **dict.fromkeys(("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"), _KIMI_DELTA_ROUTES),
}
"""Hugging Face's sequence mixers whose modeling module's functions run per document across the shards under a step,
and those functions: Mamba2 mixers (an input projection, ``causal_conv1d_forward``, ``mamba2_scan_forward``, a gated
norm, an output projection), Mamba ones (``causal_conv1d_forward``, ``mamba_scan_forward``; Mamba's fused
``mamba_inner_fn`` skipped), Gated DeltaNet ones (``causal_conv1d_forward``, ``torch_chunk_gated_delta_rule``) and
Kimi delta attention ones (``causal_conv1d_forward``, ``chunk_kimi_delta_attention``: the same rule with a decay per
key channel)."""


_BOUND_KERNELS = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule", "causal_conv1d_fn")
"""Attributes through which other transformers releases' mixers call their kernels (bound in ``__init__``): such a
mixer would not call the routed module functions, so it is left alone."""


def _modeling_module(mixer: torch.nn.Module) -> tuple[Any, dict[str, Callable[..., Any]]]:
    """The modeling module whose functions ``mixer``'s forward calls (that of its Hugging Face class, past wrappers),
    and the routes of its family."""
    cls = next(cls for cls in type(mixer).__mro__ if cls.__name__ in _ROUTED_MIXERS)
    return sys.modules[cls.__module__], _ROUTED_MIXERS[cls.__name__]


def _use_cp_sequence_mixers(model: torch.nn.Module) -> None:
    """Route the convolution and scan of every mixer family of ``_ROUTED_MIXERS`` in ``model`` through lightning_cp
    under a step (its modeling module's functions; weights, forward and everything outside a step unchanged). A
    modeling module without those functions (older transformers, remote code) is left alone: its layers stay refused
    at cp > 1."""
    for mixer in model.modules():
        if comm.original_class_name(mixer) not in _ROUTED_MIXERS:
            continue
        modeling, routes = _modeling_module(mixer)
        bound = any(hasattr(mixer, name) for name in _BOUND_KERNELS)  # calls its own attribute, not the module's
        if bound or not all(callable(getattr(modeling, name, None)) for name in routes):
            continue
        for name, under_step in routes.items():
            if not isinstance(original := getattr(modeling, name), _RoutedUnderCP):
                setattr(modeling, name, _RoutedUnderCP(original, under_step))


def _routed_mixer_count(model: torch.nn.Module) -> int:
    """How many sequence mixers of ``model`` (of the families of ``_ROUTED_MIXERS``) run through lightning_cp under a
    step."""
    mixers = [module for module in model.modules() if comm.original_class_name(module) in _ROUTED_MIXERS]
    return sum(
        all(isinstance(getattr(modeling, name, None), _RoutedUnderCP) for name in routes)
        and not any(hasattr(mixer, name) for name in _BOUND_KERNELS)
        for mixer, (modeling, routes) in zip(mixers, map(_modeling_module, mixers), strict=True)
    )


def _exact_layer_types(model: torch.nn.Module, layer_types: tuple[str, ...]) -> frozenset[str]:
    """Layer types whose token mixing is exact under a step in ``model``: attention; ``conv`` when every
    short-convolution mixer runs ``cp_causal_conv1d``; ``linear_attention`` and ``hybrid`` when each such layer holds a
    routed mixer (other linear attention, such as MiniMax's lightning attention, is not)."""
    exact = set(_TOKEN_WISE_LAYER_TYPES)
    mixers = [module for module in model.modules() if comm.original_class_name(module) in _SHORT_CONVOLUTIONS]
    if mixers and all(isinstance(mixer.forward, _ShortConvolutionUnderCP) for mixer in mixers):
        exact.add("conv")
    scanned = sum(kind in ("linear_attention", "hybrid") for kind in layer_types)
    if scanned and _routed_mixer_count(model) == scanned:
        exact |= {"linear_attention", "hybrid"}
    return frozenset(exact)


def _row_order_problems(model: torch.nn.Module) -> list[str]:
    """What a model computes from its row's own token order, so wrongly once a step spreads a document over ranks
    or packs several into a row: layers that mix tokens without attention (state-space and linear attention layers of
    hybrid models, convolutions other than the LFM2 family's) and Llama 4's attention temperature on its NoPE layers
    (from row positions)."""
    text = model.config.get_text_config()
    layer_types = tuple(getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ())
    others = sorted({str(kind) for kind in layer_types} - _exact_layer_types(model, layer_types))
    problems = [f"layers of type {', '.join(others)}"] if others else []
    if getattr(text, "attn_temperature_tuning", False) and 0 in (getattr(text, "no_rope_layers", None) or ()):
        problems.append("attn_temperature_tuning on NoPE layers")
    return problems


def _logit_changes(config: Any) -> list[str]:
    """The config fields, set, by which a model's forward changes its logits after the output projection (Gemma 2/3's
    soft-capping, Cohere's and Granite's scales)."""
    text = config.get_text_config()
    softcap = getattr(text, "final_logit_softcapping", None)
    changes = [] if softcap is None else [f"final_logit_softcapping={softcap}"]
    for field in ("logit_scale", "logits_scaling"):
        if (scale := getattr(text, field, None)) not in (None, 1):
            changes.append(f"{field}={scale}")
    return changes


def _compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` compiled the module's calls."""
    return getattr(module, "_compiled_call_impl", None) is not None


class HFCausalLM(CausalLMModule):
    """A LightningModule around any ``AutoModelForCausalLM``, trained with the CP-aware loss.

    Args:
        model_or_path: a model instance, or a local folder (or hub name) for ``from_pretrained``.
        lr, weight_decay, betas, warmup_steps, min_lr_ratio: AdamW with linear warm-up and cosine decay.
        gradient_checkpointing: call the model's ``activation_checkpointing_enable()``
            (``gradient_checkpointing_enable()`` in transformers releases without it).
        loss_chunk_tokens: above 0, the loss makes the logits this many tokens at a time from the decoder's hidden
            states (``cp_chunked_cross_entropy``), so the ``tokens x vocab`` logits never exist at once. A model whose
            forward changes its logits after the output projection (soft-capping, scaling) is refused at the first
            step, on a probe of a few tokens.
        **from_pretrained: keyword arguments of ``from_pretrained``; ``dtype`` defaults to float32 (the weights
            train in it; ``bf16-mixed`` computes in bf16), not the checkpoint's own dtype.

    The model is switched to the ``"lightning_cp"`` attention (and its LFM2-family short convolutions to
    ``cp_causal_conv1d`` under a step), and to training mode when it comes wholly in
    evaluation mode (as ``from_pretrained`` returns it; Lightning would keep it so); labels are never passed to it
    (the batch's are already shifted per document), the loss is ``cp_cross_entropy`` on its logits (with
    ``loss_chunk_tokens``, ``cp_chunked_cross_entropy`` on the decoder's hidden states).
    """

    _PROBE_TOKENS = 8

    def __init__(
        self,
        model_or_path: PreTrainedModel | str,
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        gradient_checkpointing: bool = False,
        loss_chunk_tokens: int = 0,
        **from_pretrained: Any,
    ) -> None:
        super().__init__()
        if isinstance(loss_chunk_tokens, bool) or not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 0:
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens!r}: expected 0 (whole logits) or a token count")
        if isinstance(model_or_path, str):
            from_pretrained.setdefault("dtype", torch.float32)  # trainable weights; the Trainer's precision casts
            model = AutoModelForCausalLM.from_pretrained(
                model_or_path, attn_implementation=ATTENTION_NAME, **from_pretrained
            )
        else:
            model = model_or_path
            model.set_attn_implementation(ATTENTION_NAME)
        _use_cp_short_convolutions(model)
        _use_cp_sequence_mixers(model)
        if getattr(model.config.get_text_config(), "alibi", False):
            raise ValueError(
                f"{type(model).__name__} uses ALiBi position biases, which the '{ATTENTION_NAME}' attention cannot add"
            )
        if not any(module.training for module in model.modules()):  # as from_pretrained returns it; Lightning keeps it
            model.train()
        if gradient_checkpointing:  # newer transformers renamed it; the old name warns there
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        self.model = model
        self.loss_chunk_tokens = loss_chunk_tokens
        self._head_checked = False
        self.save_hyperparameters(
            {
                "lr": lr,
                "weight_decay": weight_decay,
                "betas": betas,
                "warmup_steps": warmup_steps,
                "min_lr_ratio": min_lr_ratio,
                "gradient_checkpointing": gradient_checkpointing,
                "loss_chunk_tokens": loss_chunk_tokens,
            }
        )

    @override
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the model's logits of this rank's tokens (no labels: the loss is computed CP-aware)."""
        self._check_attention()
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    def _check_attention(self) -> None:
        """Refuse a CP step with a model switched away from the ``"lightning_cp"`` attention, and a step that spreads
        documents over ranks or packs them for a model that computes from its row's token order."""
        step = active_step()
        if step is None:
            return
        implementation = self.model.config._attn_implementation
        packed = step.contiguous_packed_seq_params is not None
        if step.cp_size == 1 and not packed:
            return  # one document per row on one device: the model computes what it would alone
        where = f"cp={step.cp_size}" if step.cp_size > 1 else "a packed batch"
        if implementation != ATTENTION_NAME:
            raise RuntimeError(
                f"{where} but the model's attn_implementation is {implementation!r}, not {ATTENTION_NAME!r}: the "
                "forward would make no cp_attention call and attend within each shard only, or across the packed "
                "documents"
            )
        rope = _rope_length_limit(self.model.config)
        if rope is not None and (longest := _longest_document(0)) > rope[1]:
            raise ValueError(
                f"{type(self.model).__name__} rescales its rotary frequencies (rope_type={rope[0]}) by the longest "
                f"position of the row it is given, past {rope[1]} tokens; a document of {longest} tokens under "
                f"{where} would be rescaled otherwise than alone on one device: keep documents within {rope[1]} "
                "tokens, or train at cp=1 on one document per row"
            )
        problems = _row_order_problems(self.model)
        if problems:
            raise ValueError(
                f"{type(self.model).__name__} computes {' and '.join(problems)} from its row's own token order, which "
                f"{where} breaks; train it at cp=1 on one document per row"
            )

    @override
    def token_loss(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, loss_token_count: int
    ) -> CPLoss:
        """Return the loss of this rank's tokens; with ``loss_chunk_tokens`` the logits are made chunk by chunk from
        the decoder's hidden states."""
        if not self.loss_chunk_tokens:
            return super().token_loss(input_ids, position_ids, labels, loss_token_count)
        self._check_attention()
        if not self._head_checked:
            self._check_head_makes_the_logits(input_ids.device)
            self._warn_if_compiled_past_the_decoder()
            self._head_checked = True
        causal_lm = self._causal_lm()
        hidden = causal_lm.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        head = causal_lm.get_output_embeddings()
        return cp_chunked_cross_entropy(hidden, head, labels, loss_token_count, self.loss_chunk_tokens)

    def _causal_lm(self) -> PreTrainedModel:
        """The causal LM whose decoder and output projection the chunked loss calls: the model, or the one a PEFT
        model wraps (a PEFT model's ``base_model`` is its adapter wrapper, whose forward makes the logits)."""
        get_base_model = getattr(self.model, "get_base_model", None)
        return get_base_model() if callable(get_base_model) else self.model

    def _warn_if_compiled_past_the_decoder(self) -> None:
        """Warn when the model is compiled in place but its decoder is not: the chunked loss calls the decoder and the
        output projection directly, so ``model.compile()`` would never run (the model would train eagerly)."""
        if _compiled_in_place(self.model) and not _compiled_in_place(self._causal_lm().base_model):
            rank_zero_warn(
                "loss_chunk_tokens calls the decoder and the output projection directly, past model.compile(), so "
                "the model trains eagerly: compile the decoder instead (model.base_model.compile(); for a PEFT model "
                "model.get_base_model().base_model.compile()), which the loss with and without chunks calls"
            )

    def _check_head_makes_the_logits(self, device: torch.device) -> None:
        """Check, on a few tokens on one device (no CP step, evaluation mode, no gradients), that the output
        projection of the decoder's hidden states is what the model's forward returns as logits; raise if not."""
        model, causal_lm = self.model, self._causal_lm()
        name = type(causal_lm).__name__
        if causal_lm.base_model is causal_lm or causal_lm.get_output_embeddings() is None:
            raise ValueError(f"loss_chunk_tokens needs a decoder and an output projection, which {name} does not name")
        changes = _logit_changes(model.config)
        if changes:
            raise ValueError(
                f"loss_chunk_tokens: {name}'s forward changes its logits after the output projection "
                f"({', '.join(changes)}), so logits made chunk by chunk would differ: set loss_chunk_tokens=0"
            )
        positions = torch.arange(self._PROBE_TOKENS, device=device).unsqueeze(0)
        ids = positions.remainder(model.config.vocab_size)
        modes = {module: module.training for module in model.modules()}  # frozen parts may sit in eval mode
        model.eval()
        try:
            with torch.no_grad(), activated(None):
                logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
                decoder = causal_lm.base_model
                hidden = decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
                projected = causal_lm.get_output_embeddings()(hidden).to(logits.dtype)  # a forward may upcast them
        finally:
            for module, training in modes.items():
                module.training = training
        if projected.shape != logits.shape or not torch.allclose(projected, logits, rtol=1e-3, atol=1e-5):
            raise ValueError(
                f"loss_chunk_tokens: {name}'s forward changes its logits after the output projection (soft-capping or "
                "scaling), so logits made chunk by chunk would differ: set loss_chunk_tokens=0"
            )

    @override
    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Return the logits of this rank's tokens."""
        return self(input_ids, position_ids)
