"""Checks for the exercises of 15_distributed (averaging gradients by hand, sharding per epoch).

15.1 needs ranks that make collectives together. Starting processes would take longer than a
check may, so threads stand in for the ranks: `_LockstepRanks.all_reduce_sum` pairs up the k-th
call of every rank, as a real collective does, sums the tensors, and reports ranks that call it a
different number of times or with different shapes instead of hanging on them.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit.exercises import NotYet, by_how_much, exercise, run_beside

# Importing this module registers its checks with @exercise; nothing here is called by name.
__all__: list[str] = []

NOTEBOOK = "15_distributed"
WORLD_SIZE = 3
# Rank that does not use the branch layer in its forward pass, so its .grad stays None there.
SKIPPING_RANK = 2
# A rank waiting this long in a collective for the others is stuck (a rank that finished without the
# call is noticed at once; this bounds an answer that hangs some other way).
COLLECTIVE_WAIT_S = 2.0
TOLERANCE = 1e-12


class _CollectiveMismatch(Exception):
    """The ranks' collectives did not pair up (different counts or shapes)."""


def _on_lockstep_ranks(average_gradients: Callable, replicas: list[nn.Module]) -> None:
    """The answer on every replica at once, one thread-rank each, where the answer runs: the replicas'
    gradients come back as they leave them."""
    ranks = _LockstepRanks(WORLD_SIZE)
    ranks.run(lambda rank: average_gradients(replicas[rank], ranks.all_reduce_sum_for(rank), WORLD_SIZE))


class _LockstepRanks:
    """Threads standing in for ranks of one process group, with a summing all-reduce.

    The k-th call of every rank forms one collective. A rank that arrives at call k waits until
    every rank has made its k-th call, or until a rank finished without making it (a mismatch,
    reported at once instead of waiting), or for `COLLECTIVE_WAIT_S` at most.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.condition = threading.Condition()
        self.deposits: dict[int, dict[int, torch.Tensor]] = {}
        self.calls = [0] * world_size
        self.finished = [False] * world_size
        self.mismatch = ""

    def all_reduce_sum_for(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
            """The sum of `tensor` over all ranks (every rank must call this alike)."""
            with self.condition:
                if not isinstance(tensor, torch.Tensor):
                    self._fail(f"rank {rank} passed a {type(tensor).__name__} to all_reduce_sum, not a tensor")
                index = self.calls[rank]
                self.calls[rank] += 1
                self.deposits.setdefault(index, {})[rank] = tensor.detach().clone()
                self.condition.notify_all()
                self.condition.wait_for(lambda: self._settled(index), COLLECTIVE_WAIT_S)
                return self._sum(index)

        return all_reduce_sum

    def _settled(self, index: int) -> bool:
        arrived = self.deposits[index]
        never = [r for r in range(self.world_size) if self.finished[r] and r not in arrived]
        return bool(self.mismatch) or len(arrived) == self.world_size or bool(never)

    def _sum(self, index: int) -> torch.Tensor:
        if self.mismatch:
            raise _CollectiveMismatch(self.mismatch)
        arrived = self.deposits[index]
        missing = [r for r in range(self.world_size) if r not in arrived]
        if missing:
            self._fail(f"rank {missing[0]} never made all_reduce_sum call {index + 1}")
        shapes = [tuple(arrived[r].shape) for r in range(self.world_size)]
        if len(set(shapes)) > 1:
            self._fail(f"at all_reduce_sum call {index + 1} the ranks passed tensors of shapes {shapes}")
        return torch.stack([arrived[r] for r in range(self.world_size)]).sum(0)

    def _fail(self, problem: str) -> None:
        self.mismatch = self.mismatch or problem
        self.condition.notify_all()
        raise _CollectiveMismatch(self.mismatch)

    def run(self, body: Callable[[int], object]) -> None:
        """Run body(rank) on one thread per rank; re-raise the first real error in this thread."""
        errors: list[BaseException | None] = [None] * self.world_size

        def rank_main(rank: int) -> None:
            try:
                body(rank)
            except BaseException as error:  # handed to the checking thread below
                errors[rank] = error
            with self.condition:
                self.finished[rank] = True
                self.condition.notify_all()

        threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(COLLECTIVE_WAIT_S * 4)
        real = [error for error in errors if error is not None and not _is_mismatch(error)]
        if real:
            raise real[0]
        if self.mismatch or any(errors) or len(set(self.calls)) > 1:
            raise NotYet(self._mismatch_problem(), hint=_COLLECTIVE_HINT)

    def _mismatch_problem(self) -> str:
        counts = ", ".join(f"rank {rank} {count}" for rank, count in enumerate(self.calls))
        detail = self.mismatch or "the ranks made different numbers of calls"
        return (f"the ranks' all_reduce_sum calls did not pair up: {detail} (calls made: {counts}); real ranks "
                "would sum the wrong tensors, abort or wait forever")


_COLLECTIVE_HINT = (
    "count the all_reduce_sum calls each rank makes: a rank that skipped a layer has one .grad fewer",
    "a collective pairs the n-th call of every rank, so every rank must make the same calls in the same order, "
    "even for a parameter whose .grad is None",
    (
        "call all_reduce_sum once for every parameter, in the same order on every rank, passing "
        "torch.zeros_like(parameter) where this rank's .grad is None: DDP's find_unused_parameters does the same"
    ),
)


def _is_mismatch(error: BaseException) -> bool:
    """Whether a mismatch raised by all_reduce_sum is behind this error (grading wraps the answer's errors)."""
    while error is not None:
        if isinstance(error, _CollectiveMismatch):
            return True
        error = error.__cause__
    return False


class _Branching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch, self.head = nn.Linear(4, 3), nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        hidden = torch.relu(self.trunk(x))
        return self.head(hidden + self.branch(hidden) if use_branch else hidden)


def _replicas_with_local_gradients() -> list[_Branching]:
    """One model per rank, identical weights, each with the gradient of its own batch."""
    generator = torch.Generator().manual_seed(0)
    template = _Branching().double()
    with torch.no_grad():
        for parameter in template.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    replicas = []
    for rank in range(WORLD_SIZE):
        replica = copy.deepcopy(template)
        x = torch.randn(5, 4, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 2, (5,), generator=generator)
        F.cross_entropy(replica(x, use_branch=rank != SKIPPING_RANK), y).backward()
        replicas.append(replica)
    return replicas


@exercise(
    "15.1",
    notebook=NOTEBOOK,
    title="average gradients the way DDP does",
    hint=_COLLECTIVE_HINT,
    planted="the ranks' all_reduce_sum calls did not pair up",
    answer_apart=True,
)
def check_average_gradients(average_gradients: Callable) -> str:
    """On three thread-ranks, one of which skips a layer, every rank must end with the mean gradient."""
    replicas = _replicas_with_local_gradients()
    expected = _mean_gradients(replicas)
    local = [{name: p.grad.clone() for name, p in replica.named_parameters() if p.grad is not None}
             for replica in replicas]
    run_beside(average_gradients, _on_lockstep_ranks, replicas)
    for rank, replica in enumerate(replicas):
        for name, parameter in replica.named_parameters():
            _require_not_local(parameter.grad, local[rank].get(name), name, rank)
            _require_mean(parameter.grad, expected[name], name, rank)
    return (f"on {WORLD_SIZE} ranks, one of which skipped a layer, every rank holds the mean gradient of every "
            "parameter, with the collectives paired up")


def _mean_gradients(replicas: list[_Branching]) -> dict[str, torch.Tensor]:
    names = [name for name, _ in replicas[0].named_parameters()]
    mean = {}
    for name in names:
        grads = []
        for replica in replicas:
            parameter = dict(replica.named_parameters())[name]
            grads.append(parameter.grad if parameter.grad is not None else torch.zeros_like(parameter))
        mean[name] = torch.stack(grads).mean(0)
    return mean


def _require_not_local(grad: torch.Tensor | None, local: torch.Tensor | None, name: str, rank: int) -> None:
    """Name an answer that scaled each rank's own gradient without combining the ranks'."""
    if grad is None or local is None or grad.shape != local.shape:
        return
    if torch.allclose(grad.detach(), local / WORLD_SIZE, rtol=0, atol=TOLERANCE) and not torch.allclose(
        local, local / WORLD_SIZE, rtol=0, atol=TOLERANCE
    ):
        raise NotYet(
            f"{name}'s gradient on rank {rank} is that rank's own gradient divided by world_size: the ranks' "
            "gradients were never added together",
            hint=(
                "what does one rank know about the other ranks' gradients before a collective runs?",
                "each rank sees only its own .grad until a collective combines them: pass it to all_reduce_sum first",
            ),
        )


def _require_mean(grad: torch.Tensor | None, expected: torch.Tensor, name: str, rank: int) -> None:
    if grad is None:
        raise NotYet(f"after your function, {name} has no gradient on rank {rank}", hint=_COLLECTIVE_HINT)
    if grad.shape != expected.shape:
        raise NotYet(f"{name}'s gradient on rank {rank} has shape {tuple(grad.shape)}, not {tuple(expected.shape)}")
    difference = (grad.detach() - expected).abs().max().item()
    if difference <= TOLERANCE:
        return
    if (grad.detach() - expected * WORLD_SIZE).abs().max().item() <= TOLERANCE:
        raise NotYet(
            f"{name}'s gradient on rank {rank} is the sum over the ranks, {WORLD_SIZE} times the average",
            hint="divide the summed gradient by world_size",
        )
    raise NotYet(f"{name}'s gradient on rank {rank} differs {by_how_much(difference)} from the mean over the ranks")


# ---- 15.2 -------------------------------------------------------------------------------------

SAMPLER_CASES = ((64, 2), (10, 3), (7, 4))
EPOCHS = 3
# Below this many samples two epochs can shuffle a rank's few indices alike by chance.
RESHUFFLE_CHECKED_FROM = 32


@exercise(
    "15.2",
    notebook=NOTEBOOK,
    title="shard files per rank and per epoch, without a sampler",
    hint=(
        "print each rank's shards for one epoch: do the ranks together read every shard exactly once (up to "
        "padding)? and do two epochs differ?",
        "every rank must compute the same permutation (so that their slices do not overlap), and a different one "
        "each epoch: that is what DistributedSampler's seed + epoch does",
        (
            "shuffle with torch.randperm(num_shards, generator=torch.Generator().manual_seed(seed + epoch)) on every "
            "rank, pad the order to a multiple of world_size by repeating its start, and take order[rank::world_size]"
        ),
    ),
    planted="no rank reads",
    answer_apart=True,
)
def check_rank_shards(rank_shards: Callable) -> str:
    """Shards must cover the files with equal lengths, repeat for a seed, and change with the epoch."""
    for shards_total, world_size in SAMPLER_CASES:
        per_epoch = []
        for epoch in range(EPOCHS):
            shards = [_indices(rank_shards, shards_total, rank, world_size, epoch) for rank in range(world_size)]
            _require_shards(shards, shards_total, world_size, epoch)
            again = _indices(rank_shards, shards_total, 0, world_size, epoch)
            if again != shards[0]:
                raise NotYet(f"two calls for rank 0, epoch {epoch} and the same seed gave different shards",
                             hint="derive the order from seed and epoch only, so that a run can be repeated")
            per_epoch.append(shards[0])
        if shards_total >= RESHUFFLE_CHECKED_FROM:
            _require_reshuffle(per_epoch, shards_total, world_size)
    return (f"in {len(SAMPLER_CASES)} set-ups the ranks read every shard with equal shares, the same seed "
            f"repeats, and each of {EPOCHS} epochs is shuffled differently")


def _indices(rank_shards: Callable, shards_total: int, rank: int, world_size: int, epoch: int) -> list[int]:
    returned = rank_shards(shards_total, rank, world_size, epoch, 7)
    try:
        return [int(index) for index in returned]
    except TypeError:
        raise NotYet(f"rank_shards returned a {type(returned).__name__}, not a list of shard numbers") from None


def _require_shards(shards: list[list[int]], samples: int, world_size: int, epoch: int) -> None:
    share = math.ceil(samples / world_size)
    lengths = [len(shard) for shard in shards]
    if len(set(lengths)) > 1:
        raise NotYet(
            f"with {samples} shards on {world_size} ranks in epoch {epoch}, the ranks got {lengths} shards: "
            "they would run different numbers of steps, and the last collective would wait forever",
            hint=f"give every rank {share} shards, repeating a few to pad (DistributedSampler does the same)",
        )
    covered = {index for shard in shards for index in shard}
    if covered != set(range(samples)):
        missing = sorted(set(range(samples)) - covered)
        if not missing:
            raise NotYet(f"the ranks got shard numbers outside range({samples})")
        read = [index for shard in shards for index in shard]
        if len(read) == len(set(read)):
            raise NotYet(
                f"with {samples} shards on {world_size} ranks in epoch {epoch}, no rank reads shards {missing[:5]}: "
                f"{samples} shards do not split into {world_size} equal shares, and the ones left over were dropped",
                hint=f"give every rank {share} shards, padding with repeats rather than dropping the remainder",
            )
        raise NotYet(f"with {samples} shards on {world_size} ranks in epoch {epoch}, no rank reads shards "
                     f"{missing[:5]}, while others are read twice: the ranks did not slice one common order")
    if lengths[0] > share:
        raise NotYet(f"with {samples} shards on {world_size} ranks, each rank got {lengths[0]} shards, "
                     f"more than the {share} needed: the ranks repeat each other's shards")


def _require_reshuffle(per_epoch: list[list[int]], samples: int, world_size: int) -> None:
    for epoch in range(1, len(per_epoch)):
        if per_epoch[epoch] == per_epoch[epoch - 1]:
            raise NotYet(f"with {samples} shards on {world_size} ranks, rank 0 got the same shards in the same "
                         f"order in epochs {epoch - 1} and {epoch}")
