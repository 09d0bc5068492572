"""Cross-entropy whose gradient, averaged over DP x CP, equals the single-device gradient of the replica's mean loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_cp.core import comm
from lightning_cp.core.sharding import IGNORE_INDEX
from lightning_cp.core.step import active_step


class CPLoss(NamedTuple):
    """The loss to backpropagate and the detached replica-wide mean to log."""

    loss: torch.Tensor
    mean: torch.Tensor


def cp_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, loss_token_count: int) -> CPLoss:
    """Sum the token losses of this rank's shard and normalise them by the replica's valid-token count.

    ``logits`` are ``[..., V]`` and ``labels`` the matching shifted targets (``-100`` ignored). Each CP rank's
    ``loss`` is multiplied by the CP size because DDP averages gradients over DP x CP: the CP average then becomes the
    gradient of the sum over the replica's tokens divided by ``loss_token_count``. ``mean`` is that replica mean.
    """
    return _normalised(_token_loss_sum(logits, labels), loss_token_count)


@comm.eager_under_compile
def cp_chunked_cross_entropy(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    loss_token_count: int,
    chunk_tokens: int,
) -> CPLoss:
    """``cp_cross_entropy(head(hidden), labels, loss_token_count)`` without the full-vocabulary logits at once.

    ``hidden`` ``[B, S, H]`` is cut along the sequence into chunks of about ``chunk_tokens`` tokens; each chunk's
    logits exist only while its loss is summed and are recomputed in the backward (``torch.utils.checkpoint``), where
    they become their own gradient in place when the head is a linear projection, so the loss needs one
    ``chunk_tokens x vocab`` buffer instead of ``B x S x vocab`` logits. ``head`` maps ``[B, s, H]`` to ``[B, s, V]``
    (the output projection, tensor-parallel styles included).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    length = max(1, chunk_tokens // max(1, hidden.shape[0]))
    sums = [
        checkpoint(_head_loss_sum, head, part, part_labels, use_reentrant=False)
        for part, part_labels in zip(hidden.split(length, dim=1), labels.split(length, dim=1), strict=True)
    ]
    return _normalised(torch.stack(sums).sum(), loss_token_count)


def _head_loss_sum(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor) -> Any:
    """Return the summed token loss of one chunk's logits."""
    logits = head(hidden)
    return _ChunkLossSum.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


_GRADIENT_ROWS = 256
_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0"})
_OUTPUT_FREE_NODES = frozenset({"MmBackward0", "AddmmBackward0", "BmmBackward0", "AddBackward0", "MulBackward0"})


def _logits_reusable(logits: torch.Tensor) -> bool:
    """Whether the op that made ``logits`` (a matmul, its bias or scale; views looked through) keeps none of its
    output for its backward, so the loss's backward may overwrite them with their gradient."""
    node = logits.grad_fn
    while node is not None and type(node).__name__ in _VIEW_NODES:
        node = node.next_functions[0][0]
    return node is not None and type(node).__name__ in _OUTPUT_FREE_NODES


class _ChunkLossSum(torch.autograd.Function):
    """``_token_loss_sum`` of one chunk's logits whose backward computes their gradient (softmax minus one-hot) a
    slice of rows at a time, into the logits themselves when nothing else needs them (``_logits_reusable``): one
    logits buffer per chunk instead of logits, log-softmax and two gradients."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        valid = labels != IGNORE_INDEX
        targets = labels.masked_fill(~valid, 0)
        accumulate = _accumulation_dtype(logits)
        lse = torch.logsumexp(logits.to(accumulate), dim=-1)
        target_logits = logits.gather(1, targets.unsqueeze(1)).squeeze(1).to(accumulate)
        ctx.save_for_backward(logits, lse, targets, valid)
        ctx.reusable = _logits_reusable(logits)
        return ((lse - target_logits) * valid).sum()  # in the accumulation dtype, as cross-entropy under autocast

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        if torch.is_grad_enabled():  # computed in place from saved values
            raise RuntimeError("cp_chunked_cross_entropy has no second-order gradient (create_graph=True)")
        logits, lse, targets, valid = ctx.saved_tensors
        grad = logits if ctx.reusable else torch.empty_like(logits)
        scale = valid * grad_output.to(lse.dtype)
        for rows in range(0, logits.shape[0], _GRADIENT_ROWS):  # exp in the accumulation dtype
            part = slice(rows, rows + _GRADIENT_ROWS)
            probs = (logits[part].to(lse.dtype) - lse[part].unsqueeze(1)).exp_()
            probs.scatter_add_(1, targets[part].unsqueeze(1), -torch.ones_like(probs[:, :1]))
            grad[part] = probs.mul_(scale[part].unsqueeze(1))
        return grad, None


def _accumulation_dtype(logits: torch.Tensor) -> torch.dtype:
    """The dtype losses are summed in: float32 at least, as cross-entropy under autocast and Hugging Face's loss."""
    return torch.promote_types(logits.dtype, torch.float32)


def _token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum the cross-entropy of the valid targets (``-100`` ignored; int32 labels, such as shifted int32 ids, too), in
    float32 at least: bf16 logits are upcast, as Hugging Face's loss and cross-entropy under autocast do."""
    accumulate = _accumulation_dtype(logits)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(accumulate),
        labels.reshape(-1).long(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


@comm.eager_under_compile
def _normalised(token_loss_sum: torch.Tensor, loss_token_count: int) -> CPLoss:
    """Scale this rank's loss sum for the gradient average over DP x CP; the mean is the replica's."""
    token_count = max(int(loss_token_count), 1)
    step = active_step()
    if step is not None:
        step.require_stream_at_boundary("the loss")
    if step is None or step.loss_group is None:
        loss = token_loss_sum / token_count
        return CPLoss(loss, loss.detach())
    replica_sum = comm.all_reduce_sum(token_loss_sum, step.loss_group)
    return CPLoss(token_loss_sum * (step.cp_size / token_count), replica_sum / token_count)
