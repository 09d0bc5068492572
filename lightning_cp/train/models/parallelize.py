"""The reference decoder's tensor-parallel plan: column/row-parallel projections, and with sequence parallelism
``SequenceParallel`` norms, embedding and head over a residual stream sharded over TP x CP."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lightning_cp.train.models.llama import LlamaConfig, LlamaDecoder, layer_kinds

SEQUENCE_DIM = 1  # hidden states are [B, S, hidden]


def check_tensor_parallel_size(config: LlamaConfig, tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` unless ``tensor_parallel_size`` divides the heads, kv heads and MLP width (and every layer
    is an attention layer: the plan has no recurrent or convolution ones)."""
    others = sorted(set(layer_kinds(config.num_layers, config.layer_types)) - {"attention"})
    if tensor_parallel_size > 1 and others:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} with {' and '.join(others)} layers in model.layer_types: "
            "tensor parallelism has a plan for attention layers only"
        )
    sizes = {
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, size in sizes.items():
        if size % tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} does not divide model.{name}={size}: each TP rank "
                "holds an equal share of the heads and of the MLP"
            )


def tensor_parallel_plan(num_layers: int, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Return the ``parallelize_module`` plan of ``LlamaDecoder``.

    Without sequence parallelism the residual stream is replicated over the TP ranks: q/k/v and gate/up are
    column-parallel, o/down row-parallel (their outputs all-reduced). With it, the stream is sharded on the sequence:
    norms, embedding and head are ``SequenceParallel`` (replicated weights whose gradients are summed over TP), the
    attention and MLP gather the sequence (and the attention its position ids) and the row-parallel projections
    reduce-scatter back to sequence shards.
    """
    sequence = Shard(SEQUENCE_DIM)
    plan: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        plan["embed_tokens"] = SequenceParallel(use_local_output=True)
        plan["norm"] = SequenceParallel(use_local_output=True)  # plain hidden states for a chunked loss
        plan["lm_head"] = SequenceParallel(use_local_output=True)
    for index in range(num_layers):
        layer = f"layers.{index}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}.attention.{name}"] = ColwiseParallel()
        for name in ("gate_proj", "up_proj"):
            plan[f"{layer}.mlp.{name}"] = ColwiseParallel()
        output = {"output_layouts": sequence} if sequence_parallel else {}
        plan[f"{layer}.attention.o_proj"] = RowwiseParallel(**output)
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel(**output)
        if sequence_parallel:
            plan[f"{layer}.attention_norm"] = SequenceParallel()
            plan[f"{layer}.mlp_norm"] = SequenceParallel()
            plan[f"{layer}.attention"] = PrepareModuleInput(
                input_layouts=(sequence, sequence),
                desired_input_layouts=(Replicate(), Replicate()),
                use_local_output=True,
            )
            plan[f"{layer}.mlp"] = PrepareModuleInput(
                input_layouts=(sequence,), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    return plan


def apply_tensor_parallel(
    decoder: LlamaDecoder, config: LlamaConfig, mesh: DeviceMesh, sequence_parallel: bool
) -> None:
    """Shard ``decoder`` over the 1-D tensor-parallel ``mesh`` (checked first, so a bad size fails before any
    collective) and tie the head to the embedding again if they were tied."""
    check_tensor_parallel_size(config, mesh.size())
    tied = decoder.lm_head.weight is decoder.embed_tokens.weight
    parallelize_module(decoder, mesh, tensor_parallel_plan(config.num_layers, sequence_parallel))
    if tied:
        decoder.lm_head.weight = decoder.embed_tokens.weight
