"""A deterministic, resumable sampler: the data order is a pure function of the seed, epoch and batch index."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Yield this data-parallel rank's share of ``passes`` seeded passes over ``num_samples`` samples per epoch.

    The stream of one epoch (after the samples a resumed run had done, see ``resume``) is cut to a multiple of
    ``num_replicas * batch_size`` and dealt out round-robin, so every replica gets whole batches.
    ``resume(epoch, samples, batches)`` makes the next iteration of that epoch continue after the first ``samples``
    samples of its stream, which is how a resumed run continues with the same data order, also at another
    data-parallel size: no sample of the epoch is repeated or left out.

    Pass ``p`` of epoch ``e`` is shuffled with ``seed + e * passes + p``, so with one pass per epoch, epoch ``e`` has
    the order of pass ``e`` of an epoch of several. ``follows_epochs=False`` keeps the sampler on the epoch ``resume``
    gave whatever epoch Lightning starts: ``max_steps`` alone reads one stream of passes, and a finished run extended
    with more steps, for which Lightning starts a new epoch, continues it.

    ``complete`` (evaluation): nothing is cut. The samples after the last whole round are dealt out round-robin as
    one more, shorter batch per replica; a replica they do not reach gets ``num_samples``, a filler index for a
    sample that scores nothing, so every replica runs the same number of steps (their collectives stay paired).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int = 1,
        *,
        seed: int = 0,
        shuffle: bool = True,
        passes: int = 1,
        num_replicas: int = 1,
        rank: int = 0,
        complete: bool = False,
        follows_epochs: bool = True,
    ) -> None:
        if complete and num_samples < 1:
            raise ValueError("a complete sampler needs at least one sample")
        if not complete and num_samples < num_replicas * batch_size:
            raise ValueError(
                f"{num_samples} samples cannot fill one batch of {batch_size} on each of {num_replicas} replicas"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.passes = passes
        self.num_replicas = num_replicas
        self.rank = rank
        self.complete = complete
        self.follows_epochs = follows_epochs
        self.epoch = 0
        self._resumed: dict[int, tuple[int, int]] = {}

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches each replica sees per epoch."""
        per_round = self.num_replicas * self.batch_size
        total = self.passes * self.num_samples
        return -(-total // per_round) if self.complete else total // per_round

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields (Lightning calls this as an epoch starts); a
        sampler that does not follow epochs stays on its own."""
        if self.follows_epochs:
            self.epoch = epoch

    def resume(self, epoch: int, samples: int, batches: int) -> None:
        """Continue ``epoch`` (selected) after the first ``samples`` samples of its stream (over all replicas,
        whatever their number then), the rest dealt out afresh; ``batches`` is how many of this replica's batches of
        the epoch Lightning counts as done, so the length it reads covers them and the rest."""
        self.epoch = epoch
        self._resumed = {epoch: (max(0, samples), batches)}

    def _stream(self, first_pass: int = 0) -> torch.Tensor:
        """Return the sample order of the current epoch over all replicas, from pass ``first_pass`` on."""
        orders = []
        for p in range(first_pass, self.passes):
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch * self.passes + p)
                orders.append(torch.randperm(self.num_samples, generator=generator))
            else:
                orders.append(torch.arange(self.num_samples))
        return torch.cat(orders) if orders else torch.empty(0, dtype=torch.int64)

    def _mine(self) -> torch.Tensor:
        """This replica's samples of the current epoch, in order, after those a resumed run had done (with
        ``complete``, a filler where the last round leaves it none)."""
        per_round = self.num_replicas * self.batch_size
        if not self.complete:
            done = self._resumed.get(self.epoch, (0, 0))[0]
            first_pass = min(done // self.num_samples, self.passes)  # passes wholly done are not drawn
            rest = self._stream(first_pass)[done - first_pass * self.num_samples :]
            return rest[: rest.numel() // per_round * per_round][self.rank :: self.num_replicas]
        stream = self._stream()
        whole = stream.numel() // per_round * per_round
        rest = stream[whole:][self.rank :: self.num_replicas]
        if whole < stream.numel() and rest.numel() == 0:
            rest = torch.tensor([self.num_samples])
        return torch.cat([stream[:whole][self.rank :: self.num_replicas], rest])

    def __iter__(self) -> Iterator[int]:
        return iter(self._mine().tolist())

    def __len__(self) -> int:
        """The epoch's samples for this replica; for a resumed epoch, Lightning's count of those done before (its
        batches) and those left (it ends an epoch when it has counted this many batches)."""
        if self.complete:
            return self._mine().numel()
        samples, batches = self._resumed.get(self.epoch, (0, 0))
        return (batches + self.rounds_after(samples)) * self.batch_size

    def rounds_after(self, samples: int) -> int:
        """The whole rounds (one batch per replica) an epoch's stream holds after its first ``samples``."""
        return max(0, self.passes * self.num_samples - samples) // (self.num_replicas * self.batch_size)
