"""The core runtime without Lightning: a plain training loop, backward after the step block, recomputation exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric

from lightning_cp import (
    ContextParallelRuntime,
    ContextParallelSetting,
    LayerPolicy,
    cp_cross_entropy,
    cp_previous_state,
    cp_previous_tokens,
)
from lightning_cp.core.mesh import ParallelDims, build_context_parallel_mesh
from lightning_cp.core.step import active_step
from tests.distributed_harness import assert_same_error_on_every_rank, run_on_ranks
from tests.model_helpers import (
    HYBRID,
    LEARNING_RATE,
    LINEAR_HYBRID,
    POLICY,
    TinyTransformer,
    linear_scan,
    packed_batches,
    reference_run,
)

STEPS = 3


class _InPlaceResidual(TinyTransformer):
    """Changes every block's output in place (a no-op in value), as residual code sometimes does."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, position_ids=position_ids)
            h.mul_(1.0)
        return self.head(h)


def _plain_loop(cp: int, checkpoint: str, compiled: str = "", kinds: tuple[str, ...] = HYBRID) -> dict[str, object]:
    """Train the stack of ``kinds`` a few SGD steps by hand; the loss's backward runs after the step block has
    deactivated the step. ``compiled``: ``model`` or ``blocks`` compiled in place by ``torch.compile`` (inductor)
    after wrapping; the number of graphs dynamo has compiled in this loop is recorded after each step."""
    torch.set_num_threads(1)
    mesh = build_context_parallel_mesh("cpu", ParallelDims(1, cp, 1))
    model_type = _InPlaceResidual if checkpoint == "in-place" else TinyTransformer
    model = model_type(
        kinds,
        checkpoint_blocks=checkpoint.startswith("blocks"),
        checkpoint_attention=checkpoint == "attention",
        reentrant=checkpoint == "blocks-reentrant",
    )
    runtime = ContextParallelRuntime(
        ContextParallelSetting(mesh), LayerPolicy(**{k: tuple(v) for k, v in POLICY.items()})
    )
    runtime.wrap(model)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # a forked rank inherits its parent's
    for module in {"model": [model], "blocks": model.blocks, "": []}[compiled]:
        module.compile()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses, left_active, graphs = [], [], []
    for batch in packed_batches(STEPS):
        with runtime.step(batch) as step:
            result = model._loss(batch)
        optimizer.zero_grad()
        result.loss.backward()  # recomputation happens here, outside the block
        left_active.append(active_step() is not None or step.recomputing)
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad, group=mesh.cp_group)
            parameter.grad /= cp
        optimizer.step()
        losses.append(result.mean.item())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before)
    runtime.unwrap()
    weights = {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "left_active": left_active, "graphs": graphs}


def _assert_matches_one_process(results: list[dict[str, object]], kinds: tuple[str, ...] = HYBRID) -> None:
    """Every rank's losses and final weights equal a single-process run (float64, relative 1e-9), and no step was
    left active after a backward."""
    reference_losses, reference_weights = reference_run(
        kinds, packed_batches(STEPS), [[index] for index in range(STEPS)]
    )
    for result in results:
        assert result["left_active"] == [False] * STEPS
        for actual, (expected,) in zip(result["losses"], reference_losses, strict=True):
            assert abs(actual - expected) <= 1e-9 * abs(expected), f"{actual} != {expected}"
        for name, expected in reference_weights.items():
            error = (torch.from_numpy(result["weights"][name]) - expected).abs().max().item()
            assert error <= 1e-9 * expected.abs().max().item(), f"{name}: max error {error}"


@pytest.mark.parametrize("checkpoint", ["none", "blocks", "attention", "blocks-reentrant", "in-place"])
def test_plain_loop_matches_one_process_with_any_recomputation(checkpoint: str) -> None:
    """Hybrid stack at cp=2 (zigzag and contiguous blocks, contiguous boundary): losses and weights equal a
    single-process run (float64, relative 1e-9) whether whole blocks (reentrant or not), only the attention inside
    them, or nothing is recomputed in backward, also when block outputs are changed in place; no step state is left
    active after a backward."""
    results = run_on_ranks(_plain_loop, 2, 2, checkpoint, timeout=120)
    _assert_matches_one_process(results)


@pytest.mark.parametrize("compiled", ["model", "blocks"])
def test_a_compiled_model_or_compiled_blocks_match_one_process(compiled: str) -> None:
    """The hybrid stack compiled in place by ``torch.compile`` (inductor), whole or block by block, trains at cp=2 as
    one process does (float64, relative 1e-9): conversions, attention and the loss's reduction run eagerly between
    the compiled parts (before, inductor's backward failed on a reused staging buffer of the conversions). After the
    second batch (whose other length makes dynamo compile for dynamic shapes) no batch compiles anything new."""
    results = run_on_ranks(_plain_loop, 2, 2, "none", compiled, timeout=240)
    _assert_matches_one_process(results)
    for result in results:
        assert result["graphs"][0] > 0 and result["graphs"][2:] == result["graphs"][1:-1], result["graphs"]


def _reentrant_loop_after(disturbance: str) -> dict[str, object]:
    """Train the plain loop with reentrant block recomputation, disturbed: ``nested``, each step's block also runs a
    no-grad step of the same runtime on the next batch (other documents and token counts); ``raised``, a first step's
    backward fails inside a recomputed block (a caught out-of-memory, say) and the loop goes on without it."""
    torch.set_num_threads(1)
    mesh = build_context_parallel_mesh("cpu", ParallelDims(1, 2, 1))
    model = TinyTransformer(HYBRID, checkpoint_blocks=True, reentrant=True)
    runtime = ContextParallelRuntime(ContextParallelSetting(mesh), LayerPolicy(**POLICY))
    runtime.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    batches = packed_batches(STEPS + 1)
    if disturbance == "raised":

        def fail_in_recomputation(module: torch.nn.Module, args: object) -> None:
            if torch._C._current_graph_task_id() != -1:
                raise RuntimeError("out of memory (simulated)")

        handle = model.blocks[1].register_forward_pre_hook(fail_in_recomputation)  # runs after the runtime's
        skipped = dict(batches[-1])
        with runtime.step(skipped):
            failing = model._loss(skipped)
        with pytest.raises(RuntimeError, match="simulated"):
            failing.loss.backward()
        handle.remove()
        model.zero_grad()
    losses, left_active = [], []
    for index, batch in enumerate(batches[:STEPS]):
        with runtime.step(batch):
            result = model._loss(batch)
            if disturbance == "nested":
                other = dict(batches[index + 1])
                with torch.no_grad(), runtime.step(other):
                    model._loss(other)
        optimizer.zero_grad()
        result.loss.backward()
        left_active.append(active_step() is not None)
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad, group=mesh.cp_group)
            parameter.grad /= 2
        optimizer.step()
        losses.append(result.mean.item())
    weights = {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}
    return {"losses": losses, "weights": weights, "left_active": left_active}


@pytest.mark.parametrize("disturbance", ["nested", "raised"])
def test_reentrant_recomputation_uses_its_own_step_after_a_nested_step_or_a_failed_backward(disturbance: str) -> None:
    """A backward after the block recomputes each block with its own step's plan: also when a step of the same
    runtime ran inside the block (before, the inner batch's plan: wrong gradients or a plan error), and after an
    earlier backward failed inside a recomputed block (before, its step stayed active for good). Losses and weights
    equal a single-process run (float64, relative 1e-9)."""
    results = run_on_ranks(_reentrant_loop_after, 2, disturbance, timeout=120)
    _assert_matches_one_process(results)


def _fabric_loop(data_parallel: int, context_parallel: int) -> dict[str, object]:
    """Train the hybrid stack with Lightning Fabric's DDP over every rank: each replica takes its own batch, the
    runtime shards it over the replica's CP ranks, and DDP averages the gradients over DP x CP."""
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=data_parallel * context_parallel, strategy="ddp")
    fabric.launch()
    mesh = build_context_parallel_mesh("cpu", ParallelDims(data_parallel, context_parallel, 1))
    model = TinyTransformer(HYBRID)
    runtime = ContextParallelRuntime(ContextParallelSetting(mesh), LayerPolicy(**POLICY))
    runtime.wrap(model)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LEARNING_RATE))
    batches = packed_batches(data_parallel * STEPS)
    losses = []
    for step in range(STEPS):
        batch = dict(batches[data_parallel * step + mesh.dp_rank])
        with runtime.step(batch):
            logits = model(batch["input_ids"], batch["position_ids"])
            result = cp_cross_entropy(logits, batch["labels"], batch["loss_token_count"])
        optimizer.zero_grad()
        fabric.backward(result.loss)
        optimizer.step()
        losses.append(result.mean.item())
    weights = {name: tensor.detach().numpy().copy() for name, tensor in model.module.state_dict().items()}
    return {"losses": losses, "weights": weights, "dp_rank": mesh.dp_rank}


def test_a_fabric_loop_matches_one_process() -> None:
    """Lightning Fabric (``strategy="ddp"``, no Trainer) at dp 2 x cp 2: each replica's losses and the final weights
    equal one process averaging the two replicas' batches per step (float64, relative 1e-9)."""
    results = run_on_ranks(_fabric_loop, 4, 2, 2, init_process_group=False, timeout=120)
    order = [[2 * step, 2 * step + 1] for step in range(STEPS)]
    reference_losses, reference_weights = reference_run(HYBRID, packed_batches(2 * STEPS), order)
    for result in results:
        for actual, expected in zip(result["losses"], reference_losses, strict=True):
            reference = expected[result["dp_rank"]]
            assert abs(actual - reference) <= 1e-9 * abs(reference), (
                f"replica {result['dp_rank']}: {actual} != {reference}"
            )
    for name, expected in reference_weights.items():
        error = (torch.from_numpy(results[0]["weights"][name]) - expected).abs().max().item()
        assert error <= 1e-9 * expected.abs().max().item(), f"{name}: max error {error}"


class _TakesExtra(torch.nn.Module):
    def forward(self, h: torch.Tensor, *, extra: object) -> torch.Tensor:
        return h


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _TakesExtra()


def test_a_side_input_that_is_not_per_token_is_an_error():
    """A named side input must be a tensor or a tuple/list of tensors; anything else is refused, never skipped."""
    model = _Holder()
    runtime = ContextParallelRuntime(ContextParallelSetting(), LayerPolicy(("block",), (), ("extra",)))
    runtime.wrap(model)
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    with runtime.step(batch), pytest.raises(TypeError, match="side input 'extra' is a dict"):
        model.block(torch.zeros(1, 4, 2), extra={"not": "per token"})
    with runtime.step(dict(batch)):
        cos_sin = (torch.zeros(1, 4, 2), torch.ones(1, 4, 2))
        assert model.block(torch.zeros(1, 4, 2), extra=cos_sin).shape == (1, 4, 2)


def _runtime(cp: int) -> tuple[TinyTransformer, ContextParallelRuntime]:
    """A seeded model wrapped by a runtime over a CP group of ``cp`` ranks."""
    mesh = build_context_parallel_mesh("cpu", ParallelDims(1, cp, 1))
    torch.manual_seed(0)
    model = TinyTransformer(HYBRID).double()
    runtime = ContextParallelRuntime(ContextParallelSetting(mesh), LayerPolicy(**POLICY))
    runtime.wrap(model)
    return model, runtime


def _mean_loss(model: TinyTransformer, batch: dict) -> float:
    logits = model(batch["input_ids"], batch["position_ids"])
    return float(cp_cross_entropy(logits, batch["labels"], batch["loss_token_count"]).mean)


def _nested_steps() -> list[float]:
    """The student's loss with a teacher's step (another runtime), then this runtime's own, begun and ended inside the
    student's step block, and with none."""
    student, runtime = _runtime(2)
    teacher, teacher_runtime = _runtime(2)
    ids = (torch.arange(16).view(1, 16) * 7) % 32
    losses = []
    for inner_model, inner_runtime in ((teacher, teacher_runtime), (student, runtime), (None, None)):
        batch = {"input_ids": ids.clone()}
        with runtime.step(batch) as outer:
            if inner_runtime is not None:
                inner_batch = {"input_ids": ids.clone()}
                with inner_runtime.step(inner_batch):
                    _mean_loss(inner_model, inner_batch)
                assert active_step() is outer, "the outer step is active again"
            losses.append(_mean_loss(student, batch))
    dist.barrier()
    return losses


def test_a_step_nested_in_another_leaves_the_outer_one_active():
    """Teacher and student, or a step of the same runtime inside its own block: the outer model's loss afterwards is
    what it is without the inner step (before, the outer forward went on without CP: a different loss per rank)."""
    for losses in run_on_ranks(_nested_steps, 2, timeout=120):
        assert losses[0] == losses[1] == losses[2], losses


def _batch_differing_in(field: str) -> None:
    """Run a step whose batch differs between the two ranks only in ``field``'s values."""
    _, runtime = _runtime(2)
    rank = dist.get_rank()
    ids = (torch.arange(16).view(1, 16) * 7) % 32
    batch = {"input_ids": ids, "labels": ids.clone()}
    if field == "labels":
        batch["labels"][0, 3] = rank
    elif field == "attention_mask":
        batch["attention_mask"] = torch.ones(1, 16, dtype=torch.long)
        batch["attention_mask"][0, -1] = rank
    with runtime.step(batch):
        pass


@pytest.mark.parametrize("field", ["labels", "attention_mask"])
def test_a_batch_differing_between_ranks_in_values_fails_on_every_rank(field: str) -> None:
    """Same shapes, different label values or masks: the same error on every rank, before any collective."""
    named = "token and label values" if field == "labels" else "attention_mask"
    assert_same_error_on_every_rank(_batch_differing_in, 2, field, match=f"different {named}")


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "at least one token"),
        ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "cu_seqlens": [0, 4]}, "got a list"),
    ],
)
def test_an_empty_batch_or_offsets_that_are_not_a_tensor_are_refused(batch: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ContextParallelRuntime(ContextParallelSetting()).begin_step(dict(batch))


def test_labels_none_means_the_input_ids():
    runtime = ContextParallelRuntime(ContextParallelSetting())
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    batch = {"input_ids": ids, "labels": None}
    with runtime.step(batch):
        assert batch["labels"].tolist() == [[1, 4, 1, 5, -100]]


def _previous_tokens(
    count: int, boundary: str, tensor_parallel: int = 1
) -> tuple[list[list[float]], list[list[float]]]:
    """On contiguous shards of one dense row of 12 tokens (value = position), the ``count`` tokens before each rank's
    shard, and the gradient a sum of them sends back to the shards; with ``tensor_parallel`` > 1 under sequence
    parallelism (shards over TP x CP)."""
    dims = ParallelDims(1, dist.get_world_size() // tensor_parallel, tensor_parallel)
    mesh = build_context_parallel_mesh("cpu", dims)
    setting = ContextParallelSetting(mesh, boundary_layout=boundary, sequence_parallel=tensor_parallel > 1)
    runtime = ContextParallelRuntime(setting)
    batch = {"input_ids": torch.arange(12).unsqueeze(0), "labels": torch.arange(12).unsqueeze(0)}
    with runtime.step(batch):
        shard = batch["input_ids"].double().unsqueeze(-1).requires_grad_()
        before = cp_previous_tokens(shard, count)
        (before * torch.arange(1.0, count + 1).view(1, count, 1)).sum().backward()
    return before.flatten().tolist(), shard.grad.flatten().tolist()


def test_the_tokens_before_a_contiguous_shard_come_from_the_previous_rank() -> None:
    """Three ranks of four tokens: rank r > 0 gets positions 4r - count .. 4r - 1, rank 0 zeros; the gradient of
    token j of a shard's tail is the weight its next rank gave it (none for the last rank's tail). Under sequence
    parallelism the previous shard is the previous TP x CP rank's (before, the previous CP rank's: wrong tokens).
    Five tokens, more than a shard holds, come from the two ranks before, zeros before the sequence's start (before,
    a ValueError: a recurrent block on short shards could not run)."""
    ranks = run_on_ranks(_previous_tokens, 3, 3, "contiguous")
    assert [before for before, _ in ranks] == [[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [5.0, 6.0, 7.0]]
    assert [grad for _, grad in ranks] == [[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0]]
    sequence_parallel = run_on_ranks(_previous_tokens, 4, 2, "contiguous", 2)  # cp=2 x tp=2: 16 padded slots
    assert [before for before, _ in sequence_parallel] == [[0.0, 0.0], [2.0, 3.0], [6.0, 7.0], [10.0, 11.0]]
    assert_same_error_on_every_rank(_previous_tokens, 2, 1, "zigzag", match="needs the contiguous layout")
    longer = run_on_ranks(_previous_tokens, 3, 5, "contiguous")  # more tokens than a shard: from two ranks back
    assert [before for before, _ in longer] == [[0.0] * 5, [0.0, 0.0, 1.0, 2.0, 3.0], [3.0, 4.0, 5.0, 6.0, 7.0]]
    assert [grad for _, grad in longer] == [[2.0, 3.0, 4.0, 6.0], [2.0, 3.0, 4.0, 5.0], [0.0, 0.0, 0.0, 0.0]]


def _recurrence_across_shards(
    tensor_parallel: int = 1, rows: int = 1, decay_width: int = 3, boundary: str = "contiguous", bad_decay: bool = False
) -> list[float]:
    """A diagonal linear recurrence over dense rows of 24 tokens (a document starting mid-shard): each contiguous
    shard scans from zero and adds the cumulative decay times ``cp_previous_state``. Returns the largest differences
    to one process's scan of the whole rows: states, and gradients of inputs and decays (``decay_width`` 1: one decay
    per row and token, broadcast over the state's 3 channels, and with one row given as a 0-dim tensor; ``bad_decay``:
    two of the three channels' decays)."""
    dims = ParallelDims(1, dist.get_world_size() // tensor_parallel, tensor_parallel)
    mesh = build_context_parallel_mesh("cpu", dims)
    setting = ContextParallelSetting(mesh, boundary_layout=boundary, sequence_parallel=tensor_parallel > 1)
    runtime = ContextParallelRuntime(setting)
    length, generator = 24, torch.Generator().manual_seed(5)
    inputs = torch.randn(rows, length, 3, generator=generator, dtype=torch.float64)
    decays = 0.5 + 0.5 * torch.rand(rows, length, decay_width, generator=generator, dtype=torch.float64)
    decays[:, 10] = 0  # a document starts at token 10
    weights = torch.randn(rows, length, 3, generator=generator, dtype=torch.float64)
    whole_inputs, whole_decays = inputs.clone().requires_grad_(), decays.clone().requires_grad_()
    expected = linear_scan(whole_inputs, whole_decays)
    (expected * weights).sum().backward()
    batch = {"input_ids": torch.arange(length).repeat(rows, 1)}
    with runtime.step(batch):
        positions = batch["input_ids"][0]  # the token positions of this rank's shard
        shard_inputs = inputs[:, positions].clone().requires_grad_()
        shard_decays = decays[:, positions].clone().requires_grad_()
        from_zero = linear_scan(shard_inputs, shard_decays)
        cumulative = torch.cumprod(shard_decays, 1)
        shard_decay = cumulative[:, -1, :2] if bad_decay else cumulative[:, -1]
        if rows == 1 and decay_width == 1:
            shard_decay = shard_decay.reshape(())
        states = from_zero + cumulative * cp_previous_state(from_zero[:, -1], shard_decay).unsqueeze(1)
        (states * weights[:, positions]).sum().backward()
    pairs = [
        (states, expected[:, positions]),
        (shard_inputs.grad, whole_inputs.grad[:, positions]),
        (shard_decays.grad, whole_decays.grad[:, positions]),
    ]
    return [(actual - reference).abs().max().item() for actual, reference in pairs]


@pytest.mark.parametrize(
    ("ranks", "tensor_parallel", "rows", "decay_width"),
    [(3, 1, 1, 3), (3, 1, 2, 1), (3, 1, 1, 1), (4, 2, 1, 3)],
    ids=["cp3", "cp3-a-decay-per-row", "cp3-a-0-dim-decay", "cp2xtp2-sequence-parallel"],
)
def test_a_recurrence_carried_across_shards_matches_one_process(
    ranks: int, tensor_parallel: int, rows: int, decay_width: int
) -> None:
    """The state entering each contiguous shard, composed from every earlier shard's final state and decay, makes
    the shards' states and the gradients of inputs and decays equal one process's scan (float64, 1e-12); under
    sequence parallelism the shards follow TP x CP rank order."""
    for errors in run_on_ranks(_recurrence_across_shards, ranks, tensor_parallel, rows, decay_width):
        assert max(errors) <= 1e-12, errors


def test_a_carried_state_needs_contiguous_shards_and_a_decay_that_broadcasts() -> None:
    """In a zigzag block, or with a decay that does not broadcast to the state: the same error on every rank."""
    assert_same_error_on_every_rank(
        _recurrence_across_shards, 2, 1, 1, 3, "zigzag", match="cp_previous_state needs the contiguous layout"
    )
    assert_same_error_on_every_rank(
        _recurrence_across_shards, 2, rows=2, bad_decay=True, match="the decay's shape (2, 2) does not broadcast"
    )


def test_a_hybrid_stack_with_linear_recurrences_trains_as_one_process() -> None:
    """Attention blocks on zigzag shards and gated linear recurrences on contiguous ones, packed documents of 1 to
    13 tokens crossing shard boundaries, at cp=3 and with whole blocks recomputed at cp=2: losses and weights equal
    one process's (float64, relative 1e-9)."""
    _assert_matches_one_process(run_on_ranks(_plain_loop, 3, 3, "none", "", LINEAR_HYBRID), LINEAR_HYBRID)
    _assert_matches_one_process(run_on_ranks(_plain_loop, 2, 2, "blocks", "", LINEAR_HYBRID), LINEAR_HYBRID)


class _TokenInputBlock(torch.nn.Module):
    """A block that takes a per-token tensor positionally (as Gemma 4 does its per-layer input)."""

    def forward(self, h: torch.Tensor, per_token: torch.Tensor) -> torch.Tensor:
        return h + per_token


def _per_token_positional_input(taken_by: str, packed: bool) -> None:
    """Two zigzag blocks in a row; ``taken_by`` names the one given a per-token tensor (made from the batch, as
    per-layer inputs are) positionally."""
    mesh = build_context_parallel_mesh("cpu", ParallelDims(1, dist.get_world_size(), 1))
    model = torch.nn.ModuleDict({"first": _TokenInputBlock(), "second": _TokenInputBlock()})
    runtime = ContextParallelRuntime(ContextParallelSetting(mesh), LayerPolicy(zigzag_layers=("*TokenInputBlock",)))
    runtime.wrap(model)
    batch = {"input_ids": torch.arange(10).unsqueeze(0), "labels": torch.arange(10).unsqueeze(0)}
    if packed:
        batch["cu_seqlens"] = torch.tensor([0, 3, 10], dtype=torch.int32)
    with runtime.step(batch):
        h = batch["input_ids"].double().unsqueeze(-1)
        per_token = h * 2
        for name in ("first", "second"):
            h = model[name](h, per_token if name == taken_by else h.new_zeros(()))


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("taken_by", ["first", "second"])
def test_a_per_token_positional_input_to_a_converted_layer_is_refused(taken_by: str, packed: bool) -> None:
    """Only keyword side inputs are converted: a per-token tensor passed positionally would meet the hidden states in
    another token order, so it is refused on every rank, naming the way out; also by a layer whose input arrives
    already converted (before, only the first of a run of zigzag layers was checked)."""
    assert_same_error_on_every_rank(
        _per_token_positional_input, 2, taken_by, packed, match="takes a per-token tensor as positional argument "
        "1; it would stay in the contiguous layout while the layer runs in zigzag: pass it as a keyword named in "
        "side_inputs",
    )  # fmt: skip


def _blocks_called(order: list[int], zigzag_layers: tuple[str, ...]) -> float:
    """Run the hybrid stack's blocks in ``order`` (with ``zigzag_layers`` as the policy's attention blocks) on one
    dense batch at cp = the world size and return the loss."""
    mesh = build_context_parallel_mesh("cpu", ParallelDims(1, dist.get_world_size(), 1))
    torch.manual_seed(0)
    model = TinyTransformer(HYBRID).double()
    policy = LayerPolicy(zigzag_layers, tuple(POLICY["contiguous_layers"]), ("position_ids",))
    runtime = ContextParallelRuntime(ContextParallelSetting(mesh), policy)
    runtime.wrap(model)
    batch = {"input_ids": (torch.arange(22).view(1, 22) * 7) % 32}
    with runtime.step(batch):
        h = model.embed(batch["input_ids"])
        for index in order:
            h = model.blocks[index](h, position_ids=batch["position_ids"])
        return float(cp_cross_entropy(model.head(h), batch["labels"], batch["loss_token_count"]).mean)


@pytest.mark.parametrize(
    ("order", "zigzag_layers", "match"),
    [
        ([0, 0, 1, 2, 3, 4], ("*AttentionBlock",), "wrapped layer 0 got the residual stream in the zigzag layout, not "
         "the boundary (contiguous)"),
        ([2, 3, 0, 1, 4], ("*AttentionBlock",), "wrapped layer 2 got the residual stream in the contiguous layout"),
        ([0, 1], ("*AttentionBlock",), "the loss met the residual stream in the zigzag layout"),
        ([0, 1, 2, 3, 4], ("blocks.0", "blocks.4"), "cp_attention outside the wrapped layers met the residual stream"),
    ],
    ids=["twice", "out-of-order", "last-skipped", "unwrapped-between"],
)  # fmt: skip
def test_wrapped_layers_that_stray_from_module_order_are_refused(
    order: list[int], zigzag_layers: tuple[str, ...], match: str
) -> None:
    """The layout state converts where the module order says the layout changes: a layer run twice or out of order,
    a forward that ends in another layout, or an attention block outside the policy between wrapped ones would
    compute in a wrong token order (before: silently wrong losses on dense batches), so each is refused on every
    rank; a skipped layer whose neighbours share its layout changes nothing and trains."""
    assert_same_error_on_every_rank(_blocks_called, 2, order, zigzag_layers, match=match)


def test_a_skipped_layer_between_layers_of_its_layout_is_exact() -> None:
    """Skipping a middle block (LayerDrop) leaves every conversion where the order puts it: the loss equals one
    process running the same blocks."""
    losses = run_on_ranks(_blocks_called, 2, [0, 2, 3, 4], ("*AttentionBlock",))
    (expected,) = run_on_ranks(_blocks_called, 1, [0, 2, 3, 4], ("*AttentionBlock",))
    assert losses[0] == losses[1] and abs(losses[0] - expected) <= 1e-12 * abs(expected), (losses, expected)
