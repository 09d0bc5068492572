"""``cp_cross_entropy``: the CP-averaged gradient is the single-device gradient of the replica's mean loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp import cp_chunked_cross_entropy, cp_cross_entropy
from lightning_cp.core import loss
from lightning_cp.core.mesh import ParallelDims, build_context_parallel_mesh
from lightning_cp.core.step import ContextParallelSetting, ContextParallelStep, activated
from tests.distributed_harness import run_on_ranks

torch.set_num_threads(1)

TOKENS, FEATURES, VOCAB = 12, 5, 7


def problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return features, a shared weight and labels with ignored targets, in float64."""
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(1, TOKENS, FEATURES, generator=generator, dtype=torch.float64)
    weight = torch.randn(FEATURES, VOCAB, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (1, TOKENS), generator=generator)
    labels[0, [2, 7, 11]] = -100
    return features, weight, labels


def test_without_cp_it_is_the_mean_over_valid_tokens() -> None:
    """No active step: ``loss`` and ``mean`` are plain mean cross-entropy over the valid targets."""
    features, weight, labels = problem()
    logits = features @ weight
    result = cp_cross_entropy(logits, labels, int((labels != -100).sum()))
    expected = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)
    assert torch.allclose(result.loss, expected, rtol=1e-12, atol=0)
    assert result.mean.item() == result.loss.item()
    assert not result.mean.requires_grad


def test_int32_labels_give_the_int64_loss_in_both_losses() -> None:
    """Labels of int32 (shifted from int32 token ids) are targets like int64 ones, for the whole and chunked loss."""
    features, weight, labels = problem()
    count = int((labels != -100).sum())
    expected = cp_cross_entropy(features @ weight, labels, count).loss
    assert cp_cross_entropy(features @ weight, labels.int(), count).loss.item() == expected.item()
    chunked = cp_chunked_cross_entropy(features, lambda h: h @ weight, labels.int(), count, chunk_tokens=5).loss
    assert torch.allclose(chunked, expected, rtol=1e-12, atol=0)


def test_an_all_ignored_batch_gives_zero_not_nan() -> None:
    """Zero valid targets: the loss is 0 and finite."""
    logits = torch.randn(1, 3, VOCAB, dtype=torch.float64)
    result = cp_cross_entropy(logits, torch.full((1, 3), -100), 0)
    assert result.loss.item() == 0.0


def shard_gradient(cp_size: int) -> tuple[float, float, np.ndarray]:
    """Compute this rank's loss on its contiguous shard under an active CP step; return mean, loss and weight grad."""
    mesh = build_context_parallel_mesh("cpu", ParallelDims(1, cp_size, 1))
    features, weight, labels = problem()
    weight.requires_grad_(True)
    shard = slice(mesh.cp_rank * TOKENS // cp_size, (mesh.cp_rank + 1) * TOKENS // cp_size)
    step = ContextParallelStep(ContextParallelSetting(mesh))
    with activated(step):
        result = cp_cross_entropy(features[:, shard] @ weight, labels[:, shard], int((labels != -100).sum()))
    result.loss.backward()
    dist.barrier()  # no rank may leave (and stop rank 0's store) while another still builds its groups
    return result.mean.item(), result.loss.item(), weight.grad.numpy().copy()


def test_cp_average_of_shard_gradients_is_the_single_device_gradient() -> None:
    """Averaging the ranks' gradients (what DDP over DP x CP does) reproduces the single-device gradient."""
    features, weight, labels = problem()
    weight.requires_grad_(True)
    expected_loss = F.cross_entropy((features @ weight).view(-1, VOCAB), labels.view(-1), ignore_index=-100)
    expected_loss.backward()
    for cp_size in (2, 3):
        results = run_on_ranks(shard_gradient, cp_size, cp_size)
        assert all(abs(mean - expected_loss.item()) <= 1e-12 * expected_loss.item() for mean, _, _ in results)
        assert abs(sum(loss for _, loss, _ in results) / cp_size - expected_loss.item()) <= 1e-12
        averaged = sum(torch.from_numpy(gradient) for _, _, gradient in results) / cp_size
        assert torch.allclose(averaged, weight.grad, rtol=1e-12, atol=1e-15)


def test_chunked_loss_equals_the_whole_logits_loss_and_never_makes_them_all() -> None:
    """``cp_chunked_cross_entropy`` gives the same loss and gradients (float64, relative 1e-12) while the head only
    ever sees chunks, in the forward and in the recomputing backward."""
    features, weight, labels = problem()
    count = int((labels != -100).sum())
    whole_features = features.clone().requires_grad_(True)
    whole_weight = weight.clone().requires_grad_(True)
    expected = cp_cross_entropy(whole_features @ whole_weight, labels, count)
    expected.loss.backward()
    seen: list[int] = []
    chunk_weight = weight.clone().requires_grad_(True)
    chunk_features = features.clone().requires_grad_(True)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.shape[1])
        return hidden @ chunk_weight

    result = cp_chunked_cross_entropy(chunk_features, head, labels, count, chunk_tokens=5)
    result.loss.backward()
    assert torch.allclose(result.loss, expected.loss, rtol=1e-12, atol=0)
    assert torch.allclose(chunk_features.grad, whole_features.grad, rtol=1e-12, atol=1e-15)
    assert torch.allclose(chunk_weight.grad, whole_weight.grad, rtol=1e-12, atol=1e-15)
    assert seen[:3] == [5, 5, 2] and sorted(seen[3:]) == [2, 5, 5], seen  # forward, then the recomputation


def test_chunked_loss_in_bfloat16_stays_within_bfloat16_rounding() -> None:
    """bf16 hidden states and head: the chunked loss and gradients against float64 cross-entropy of the same bf16
    values, within bf16's rounding (relative 1e-2); the loss in float32."""
    features, weight, labels = problem()
    count = int((labels != -100).sum())
    low = [x.to(torch.bfloat16).requires_grad_(True) for x in (features, weight)]
    exact = [x.detach().double().requires_grad_(True) for x in low]
    expected = cp_cross_entropy(exact[0] @ exact[1], labels, count)
    expected.loss.backward()
    result = cp_chunked_cross_entropy(low[0], lambda hidden: hidden @ low[1], labels, count, chunk_tokens=4)
    result.loss.backward()
    assert abs(result.loss.double() - expected.loss) <= 1e-2 * expected.loss
    # The sum itself is not rounded to bf16 (as ``F.cross_entropy`` under autocast, it is float32): against the
    # float64 loss of the very bf16 logits the head made, float32's rounding (relative 1e-6).
    assert result.loss.dtype == torch.float32
    same_logits = cp_cross_entropy((low[0] @ low[1]).double(), labels, count).loss
    assert abs(result.loss.double() - same_logits) <= 1e-6 * same_logits
    for got, want in zip(low, exact, strict=True):
        assert (got.grad.double() - want.grad).norm() <= 1e-2 * want.grad.norm()


def test_a_second_order_gradient_of_the_chunked_loss_is_refused() -> None:
    """Its backward computes the logits' gradient in place: a ``create_graph`` backward through it raises a clear
    error."""
    features, weight, labels = problem()
    features.requires_grad_(True)
    loss_value = cp_chunked_cross_entropy(features, lambda hidden: hidden @ weight, labels, 9, chunk_tokens=4).loss
    with pytest.raises(RuntimeError, match="no second-order gradient"):
        torch.autograd.grad(loss_value, features, create_graph=True)


def test_loss_of_bfloat16_logits_sums_in_float32() -> None:
    """bf16 logits (``bf16-true``): the whole-logits loss is summed in float32, as Hugging Face's loss and
    cross-entropy under autocast are, so it is the float64 loss of the same logits to float32's rounding (a bf16 sum
    is off by about 1e-2 relative)."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 512, 64, generator=generator).mul(3).to(torch.bfloat16)
    labels = torch.randint(0, 64, (1, 512), generator=generator)
    result = cp_cross_entropy(logits, labels, 512)
    assert result.loss.dtype == torch.float32
    expected = F.cross_entropy(logits[0].double(), labels[0])
    assert abs(result.loss.double() - expected) <= 1e-6 * expected


@pytest.mark.parametrize("head_kind", ["linear", "linear-bias-scaled", "tanh"])
def test_chunked_loss_reuses_logits_only_when_the_head_does_not_keep_them(head_kind) -> None:
    """The backward overwrites a linear head's logits with their gradient; a head whose backward needs its output
    (tanh) gets a fresh gradient buffer: the gradients match cross-entropy of the whole logits either way."""
    features, weight, labels = problem()
    count = int((labels != -100).sum())
    bias = torch.randn(VOCAB, dtype=torch.float64)
    heads = {
        "linear": lambda hidden, w: hidden @ w,
        "linear-bias-scaled": lambda hidden, w: (hidden @ w + bias) * 0.5,
        "tanh": lambda hidden, w: torch.tanh(hidden @ w),
    }
    head = heads[head_kind]
    grads = []
    for chunk in (None, 5):
        x, w = features.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if chunk is None:
            result = cp_cross_entropy(head(x, w), labels, count)
        else:
            result = cp_chunked_cross_entropy(x, lambda hidden, w=w: head(hidden, w), labels, count, chunk)
        result.loss.backward()
        grads.append((x.grad, w.grad))
    for got, want in zip(grads[1], grads[0], strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-15)
    logits = head(features.requires_grad_(True), weight)
    assert loss._logits_reusable(logits.reshape(-1, VOCAB)) == (head_kind != "tanh")
