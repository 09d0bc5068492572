"""Cross-entropy whose gradient, averaged over DP x CP, equals the single-device gradient of the replica's mean loss."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

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
    token_loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    token_count = max(int(loss_token_count), 1)
    step = active_step()
    if step is None or step.loss_group is None:
        loss = token_loss_sum / token_count
        return CPLoss(loss, loss.detach())
    replica_sum = comm.all_reduce_sum(token_loss_sum, step.loss_group)
    return CPLoss(token_loss_sum * (step.cp_size / token_count), replica_sum / token_count)
