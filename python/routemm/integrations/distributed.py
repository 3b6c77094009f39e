"""Expert parallelism on torch.distributed: the MoE experts block with its experts spread over the
ranks of a process group.

Each rank holds a slice of the experts (an `ExpertPlacement` says which rank owns which global
expert) and its own tokens. `ep_moe_experts` sends every (token, slot) row to the rank that owns
the slot's expert (all_to_all_single, row counts exchanged first), runs the local experts there
through torch.ops.routemm.moe_experts on its exact routes (or, exact=False, its automatic route), sends the rows back and combines each
token's slots in slot order on the token's home rank with routemm's moe_combine. The result is
bit-identical to the single-process block, torch.ops.routemm.moe_experts(..., exact=True), on the
concatenated tokens, whatever the world size and placement. With `capacity=C` it is the
fixed-capacity variant for decode: fixed exchange sizes, no host read (for CUDA graph capture),
the slots over a destination's capacity dropped by a stated policy (`ep_capacity_dropped`).

Collectives block until every rank of the group joins them: give the group a timeout
(torch.distributed.init_process_group(timeout=...)) so that a rank that raises makes the others
fail with an error instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch

from ..core._errors import InvalidArgumentError, InvalidArgumentTypeError
from ..ops import _tensor_ops
from . import torch as _routemm_torch  # registers torch.ops.routemm.*

_TORCH = _tensor_ops.framework("torch")
_U32_MAX = 2**32 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """Which rank owns which global expert: owners[e] is the rank of expert e, for every expert
    0 .. n_experts - 1, so each expert has exactly one owner. A rank's local stacks hold its
    experts in increasing global order (local index i is local_experts(rank)[i]); a rank may own
    none. Build one with `contiguous` (ranges, uneven counts allowed) or `from_map` (any map)."""

    owners: tuple[int, ...]
    world_size: int

    def __post_init__(self):
        if not _is_int(self.world_size) or self.world_size < 1:
            raise InvalidArgumentError(f"ExpertPlacement world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.owners, tuple):
            raise InvalidArgumentTypeError(f"ExpertPlacement owners must be a tuple, got {type(self.owners).__name__}")
        if not 1 <= len(self.owners) <= _U32_MAX:
            raise InvalidArgumentError(f"ExpertPlacement needs 1 to 2**32 - 1 experts, got {len(self.owners)}")
        for e, r in enumerate(self.owners):
            if not _is_int(r) or not 0 <= r < self.world_size:
                raise InvalidArgumentError(
                    f"ExpertPlacement owner of expert {e} must be a rank in [0, {self.world_size}), got {r!r}"
                )

    @classmethod
    def contiguous(cls, n_experts: int, world_size: int, counts: Optional[Sequence[int]] = None) -> ExpertPlacement:
        """Rank r owns a contiguous range of experts, ranks in order: counts[r] experts each
        (non-negative ints summing to n_experts), or by default an even split, the first
        n_experts % world_size ranks taking one more."""
        for name, value in (("n_experts", n_experts), ("world_size", world_size)):
            if not _is_int(value) or value < 1:
                raise InvalidArgumentError(f"ExpertPlacement.contiguous {name} must be an int >= 1, got {value!r}")
        if counts is None:
            base, extra = divmod(n_experts, world_size)
            counts = [base + (r < extra) for r in range(world_size)]
        counts = list(counts)
        if len(counts) != world_size or not all(_is_int(c) and c >= 0 for c in counts) or sum(counts) != n_experts:
            raise InvalidArgumentError(
                f"ExpertPlacement.contiguous counts must be {world_size} non-negative ints summing to "
                f"n_experts = {n_experts}, got {counts!r}"
            )
        return cls(tuple(r for r, c in enumerate(counts) for _ in range(c)), world_size)

    @classmethod
    def from_map(cls, owners: Sequence[int], world_size: int) -> ExpertPlacement:
        """owners[e]: the rank of global expert e (a list, tuple or 1-D integer tensor)."""
        if isinstance(owners, torch.Tensor):
            owners = owners.tolist()
        if isinstance(owners, (str, bytes)) or not isinstance(owners, Sequence):
            raise InvalidArgumentTypeError(
                f"ExpertPlacement.from_map owners must be a sequence of ranks, got {type(owners).__name__}"
            )
        return cls(tuple(owners), world_size)

    @property
    def n_experts(self) -> int:
        return len(self.owners)

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """The global experts `rank` owns, in increasing order: its local stacks' order."""
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise InvalidArgumentError(f"ExpertPlacement rank must be in [0, {self.world_size}), got {rank!r}")
        return tuple(e for e, r in enumerate(self.owners) if r == rank)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner rank, local index) of every global expert, int64 tensors on `device`, built
        once per placement and device (no host-to-device copy per call)."""
        return _tables(self, torch.device(device))


@functools.lru_cache(maxsize=64)
def _tables(placement: ExpertPlacement, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    owners = torch.tensor(placement.owners, dtype=torch.int64)
    local = torch.empty_like(owners)
    for r in range(placement.world_size):
        mine = owners == r
        local[mine] = torch.arange(int(mine.sum()), dtype=torch.int64)
    return owners.to(device), local.to(device)


_CHECKED_STACKS: set = set()  # the call shapes _check_local_stacks has seen pass


def _check_local_stacks(x, gate_up, down, up, ggml_type, exact: bool) -> None:
    """The local experts' call as torch.ops.routemm.moe_experts will plan it (the stacks' shapes
    against each other and H, their dtypes, ggml_type), with a one-row stand-in for the rows: a
    rank refuses its stacks before any collective, not after its peers have sent it rows. The
    stacks are only looked at (shapes, dtypes, device, x's included); a shape that passed once is
    not planned again."""
    hidden_size = int(x.shape[1])
    device = x.device
    stacks = [t for t in (gate_up, down, up) if t is not None]
    key = (device, hidden_size, ggml_type, exact, up is None, *((t.shape, t.dtype, t.device) for t in stacks))
    if key in _CHECKED_STACKS:
        return
    x = torch.zeros((1, hidden_size), dtype=torch.float32, device=device)
    ids = torch.zeros((1, 1), dtype=torch.int32, device=device)
    w = torch.ones((1, 1), dtype=torch.float32, device=device)
    _tensor_ops._moe_experts_plan(_TORCH, x, ids, w, gate_up, down, up, ggml_type, exact)
    _CHECKED_STACKS.add(key)


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentTypeError(f"ep_moe_experts {name} must be a torch.Tensor, got {type(t).__name__}")


def ep_moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    placement: ExpertPlacement,
    group=None,
    up: Optional[torch.Tensor] = None,
    ggml_type: Optional[str] = None,
    exact: bool = True,
    capacity: Optional[int] = None,
) -> torch.Tensor:
    """The MoE experts block, expert parallel over the process group `group` (default: the world).

    Every rank calls it with its own tokens: hidden [m_r, H] (float32, float16 or bfloat16),
    top_k_index [m_r, top_k] of GLOBAL expert ids (an id outside [0, placement.n_experts), such as
    a sentinel, contributes nothing), top_k_weights [m_r, top_k]; and its local stacks: gate_up
    [E_local, 2I, H] (or the gate stack, with `up`), down [E_local, H, I], float or uint8 blocks of
    `ggml_type`, E_local = len(placement.local_experts(rank)). m_r may be 0 and differ per rank.

    Returns [m_r, H] in hidden's dtype, bit-identical to torch.ops.routemm.moe_experts(...,
    exact=True) on the concatenated tokens with the whole stacks. exact=False runs the local
    experts on the op's automatic route instead (on CUDA the tensor-core routes from the
    crossover, which it takes from the rows each rank receives): faster, within that route's
    tolerance of the exact result, without the bit-identity. Host reads: the exchanged row
    counts (one read, which all_to_all_single's split sizes need), and the combine's wait.

    capacity (an int >= 1, the same on every rank): the fixed-capacity variant for decode, made
    for CUDA graph capture: every rank sends exactly `capacity` rows to every rank (padding rows
    carry an invalid id, which the experts skip without reading a weight), so the exchanges have
    fixed sizes, no counts are exchanged, nothing is read on the host and the combine runs on the
    stream (in torch, fma for fma as routemm's combine). Policy for the slots over capacity: each rank keeps, per
    destination rank, the first `capacity` of its (token, slot) pairs in (token, slot) order and
    drops the rest; a dropped slot contributes nothing to its token, as a sentinel id does
    (`ep_capacity_dropped` gives the dropped slots, computed locally). With no slot dropped --
    always where capacity >= m_r * top_k -- the result is the same bits as without capacity."""
    import torch.distributed as dist

    for name, t in (("hidden", hidden), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
        _check_tensor(name, t)
    for name, t in (("gate_up", gate_up), ("down", down)) + ((("up", up),) if up is not None else ()):
        _check_tensor(name, t)
    if not isinstance(placement, ExpertPlacement):
        raise InvalidArgumentTypeError(
            f"ep_moe_experts placement must be an ExpertPlacement, got {type(placement).__name__}"
        )
    if not isinstance(exact, bool):
        raise InvalidArgumentTypeError(f"ep_moe_experts exact must be a bool, got {type(exact).__name__}")
    if capacity is not None:
        _check_capacity("ep_moe_experts", capacity)
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError("ep_moe_experts needs an initialised torch.distributed process group")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if placement.world_size != world:
        raise InvalidArgumentError(
            f"ep_moe_experts placement is for {placement.world_size} ranks, the group has {world}"
        )
    if hidden.dim() != 2:
        raise InvalidArgumentError(f"ep_moe_experts hidden must be [m, H], got shape {tuple(hidden.shape)}")
    m, hidden_size = (int(d) for d in hidden.shape)
    if top_k_index.dim() != 2 or int(top_k_index.shape[0]) != m:
        raise InvalidArgumentError(
            f"ep_moe_experts top_k_index must be [m = {m}, top_k], got shape {tuple(top_k_index.shape)}"
        )
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise InvalidArgumentError(
            f"ep_moe_experts top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, "
            f"got {tuple(top_k_weights.shape)}"
        )
    if top_k_index.dtype.is_floating_point or top_k_index.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise InvalidArgumentError(f"ep_moe_experts top_k_index must be integers, got {top_k_index.dtype}")
    model_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for name, t in (("hidden", hidden), ("top_k_weights", top_k_weights)):
        if t.dtype not in model_dtypes:
            raise InvalidArgumentError(f"ep_moe_experts {name} must be float32, float16 or bfloat16, got {t.dtype}")
    n_local = len(placement.local_experts(rank))
    for name, t in (("gate_up", gate_up), ("down", down)) + ((("up", up),) if up is not None else ()):
        if t.dim() != 3 or int(t.shape[0]) != n_local:
            raise InvalidArgumentError(
                f"ep_moe_experts {name} must hold rank {rank}'s {n_local} local experts [E_local, ...], "
                f"got shape {tuple(t.shape)}"
            )
    top_k = int(top_k_index.shape[1])
    if top_k < 1 or hidden_size < 1:
        raise InvalidArgumentError(f"ep_moe_experts top_k and H must be >= 1, got top_k={top_k}, H={hidden_size}")
    _routemm_torch._check_block_type(ggml_type)
    if n_local:
        _check_local_stacks(hidden, gate_up, down, up, ggml_type, exact)
    for name, t in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
        if t.device != hidden.device:
            raise InvalidArgumentError(f"ep_moe_experts {name} lives on another device than hidden")
    n_experts = placement.n_experts
    x = hidden.to(torch.float32).contiguous()
    if capacity is not None:
        out = _capacity_block(x, top_k_index, top_k_weights, placement, world, group, capacity, n_local,
                              (gate_up, down, up, ggml_type, exact))  # fmt: skip
    else:
        d = _dispatch(x, top_k_index, placement, world, group)
        done = _local_experts(d, gate_up, down, up, ggml_type, exact)
        out = _combine(d, done, top_k_weights, top_k_index, n_experts, group)
    out = out if hidden.dtype == torch.float32 else out.to(hidden.dtype)
    named = [("hidden", hidden), ("top_k_weights", top_k_weights), ("gate_up", gate_up), ("down", down), ("up", up)]
    return _TORCH.forward_only(
        "routemm.integrations.distributed.ep_moe_experts", out, [p for p in named if p[1] is not None]
    )


# ep_moe_experts' three steps, apart so that a benchmark can time each; checked arguments only.


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    sent: torch.Tensor  # flat (token, slot) index of every row sent, grouped by destination rank
    send_split: list  # rows sent to each rank
    recv_split: list  # rows received from each rank
    rows: torch.Tensor  # float32 [sum(recv_split), H]: the received token rows
    local_ids: torch.Tensor  # int32 [sum(recv_split)]: each row's expert in this rank's stacks
    m: int
    top_k: int


def _dispatch(x: torch.Tensor, top_k_index: torch.Tensor, placement: ExpertPlacement, world: int, group) -> _Dispatched:
    """Every (token, slot) with a valid id to its expert's owner: the row counts first (one host
    read), then the rows x[t] and their local expert ids, in (token, slot) order within each
    destination (a stable sort); invalid slots go nowhere (sort key `world`)."""
    import torch.distributed as dist

    m, hidden_size = (int(v) for v in x.shape)
    top_k = int(top_k_index.shape[1])
    ids = top_k_index.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < placement.n_experts)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    owner_of, local_of = placement._tables(x.device)
    dest = torch.where(valid, owner_of[safe], torch.full_like(ids, world))
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=world + 1)[:world]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_split, recv_split = torch.stack([send_counts, recv_counts]).tolist()  # the one host read
    sent = order[: sum(send_split)]
    send_rows = x[sent // top_k]
    send_local = local_of[safe[sent]].to(torch.int32)
    rows = x.new_empty((sum(recv_split), hidden_size))
    local_ids = torch.empty((sum(recv_split),), dtype=torch.int32, device=x.device)
    dist.all_to_all_single(rows, send_rows, recv_split, send_split, group=group)
    dist.all_to_all_single(local_ids, send_local, recv_split, send_split, group=group)
    return _Dispatched(sent, send_split, recv_split, rows, local_ids, m, top_k)


def _local_experts(d: _Dispatched, gate_up, down, up, ggml_type, exact: bool = True) -> torch.Tensor:
    """The owner's experts on the received rows, top_k 1 with weight exactly 1.0: each row is its
    expert's down(SiLU(gate x) * up x) as the single-process block computes it (the exact routes do
    not depend on the batch). Only a row of -0.0 comes back as +0.0, which the home combine cannot
    tell apart (its sum starts at +0.0, and +0.0 + -0.0 is +0.0)."""
    n = int(d.rows.shape[0])
    if not n:
        return d.rows
    ones = torch.ones((n, 1), dtype=torch.float32, device=d.rows.device)
    return torch.ops.routemm.moe_experts(d.rows, d.local_ids[:, None], ones, gate_up, down, up, ggml_type, exact=exact)


def _combine(d: _Dispatched, done, top_k_weights, top_k_index, n_experts: int, group) -> torch.Tensor:
    """The rows back to their home ranks (the reverse splits), each into its (token, slot) place
    (invalid slots stay zero), then the block's ordered combine: float32 [m, H]."""
    import torch.distributed as dist

    hidden_size = int(d.rows.shape[1])
    back = d.rows.new_empty((int(d.sent.shape[0]), hidden_size))
    dist.all_to_all_single(back, done, d.send_split, d.recv_split, group=group)
    slot_rows = d.rows.new_zeros((d.m * d.top_k, hidden_size))
    slot_rows[d.sent] = back
    weights = top_k_weights.to(torch.float32).contiguous()
    return _tensor_ops.moe_combine(_TORCH, slot_rows, weights, top_k_index, n_experts)


# The fixed-capacity variant: fixed exchange sizes and no host read, so a CUDA graph can hold it.


def _check_capacity(op: str, capacity) -> None:
    if not _is_int(capacity) or not 1 <= capacity <= _U32_MAX:
        raise InvalidArgumentError(f"{op} capacity must be an int in [1, 2**32 - 1], got {capacity!r}")


def _capacity_slots(top_k_index: torch.Tensor, placement: ExpertPlacement, world: int, capacity: int):
    """Per (token, slot), flat: kept (a valid id within its destination's first `capacity` slots,
    counted in (token, slot) order), its row in the send buffer (destination * capacity + place;
    world * capacity, a dump row, for the others) and its expert's local index at the owner.
    Elementwise and cumulative ops only: no host read."""
    ids = top_k_index.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < placement.n_experts)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    owner_of, local_of = placement._tables(ids.device)
    dest = torch.where(valid, owner_of[safe], torch.full_like(ids, world))
    onehot = (dest[:, None] == torch.arange(world + 1, device=ids.device)).to(torch.int64)
    place = (onehot.cumsum(0) - onehot).gather(1, dest[:, None])[:, 0]  # earlier slots, same rank
    kept = valid & (place < capacity)
    row = torch.where(kept, dest * capacity + place, torch.full_like(ids, world * capacity))
    return kept, row, local_of[safe]


def ep_capacity_dropped(top_k_index: torch.Tensor, placement: ExpertPlacement, capacity: int) -> torch.Tensor:
    """The slots ep_moe_experts(..., capacity=capacity) drops on this rank's tokens: bool [m, top_k],
    True where the id is valid but its destination rank already has `capacity` earlier (token,
    slot) pairs of this rank's. Computed on top_k_index's device from the ids alone (no collective,
    no host read), so a caller may check or log it after the step."""
    _check_tensor("top_k_index", top_k_index)
    if not isinstance(placement, ExpertPlacement):
        raise InvalidArgumentTypeError(
            f"ep_capacity_dropped placement must be an ExpertPlacement, got {type(placement).__name__}"
        )
    _check_capacity("ep_capacity_dropped", capacity)
    if top_k_index.dim() != 2 or top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise InvalidArgumentError(
            f"ep_capacity_dropped top_k_index must be integers [m, top_k], got {top_k_index.dtype} "
            f"{tuple(top_k_index.shape)}"
        )
    ids = top_k_index.reshape(-1).to(torch.int64)
    kept, _, _ = _capacity_slots(top_k_index, placement, placement.world_size, capacity)
    valid = (ids >= 0) & (ids < placement.n_experts)
    return (valid & ~kept).reshape(top_k_index.shape)


def _fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fma(a, b, c) of float32 tensors rounded once to float32, as routemm's combine computes it:
    a * b is exact in float64; the float64 sum s and its error e (TwoSum, s + e exact) give the
    float32 result, rounding s except where s falls exactly halfway between two float32 values and
    e is not zero (float64's rounding made the tie): there the exact value lies on e's side."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    bits = s.view(torch.int64)
    exp = ((bits >> 52) & 0x7FF) - 1023
    drop = (29 + (-126 - exp).clamp(min=0)).clamp(max=62)  # float64 bits below float32's last place
    one = torch.ones_like(bits)
    mask = (one << drop) - 1
    tie = torch.isfinite(s) & (e != 0) & ((bits & mask) == (one << (drop - 1))) & (exp >= -150)
    toward = (bits & ~mask).view(torch.float64).float()  # s cut to float32, exactly
    away = torch.nextafter(toward, torch.where(s > 0, torch.inf, -torch.inf).to(torch.float32))
    return torch.where(tie, torch.where((e > 0) == (s > 0), away, toward), s.float())


def _capacity_block(x, top_k_index, top_k_weights, placement, world, group, capacity, n_local, stacks):
    """Dispatch at fixed capacity, the local experts on every received row (padding rows carry
    id -1: zero rows, no weight read), the rows back, and the ordered combine of the kept slots."""
    import torch.distributed as dist

    gate_up, down, up, ggml_type, exact = stacks
    m, hidden_size = (int(v) for v in x.shape)
    top_k = int(top_k_index.shape[1])
    kept, row, local = _capacity_slots(top_k_index, placement, world, capacity)
    total = world * capacity
    flat = torch.arange(m * top_k, device=x.device)
    send_rows = x.new_zeros((total + 1, hidden_size)).index_copy_(0, row, x[flat // top_k])
    send_ids = torch.full((total + 1,), -1, dtype=torch.int32, device=x.device)
    send_ids.index_copy_(0, row, torch.where(kept, local, torch.full_like(local, -1)).to(torch.int32))
    rows, ids = x.new_empty((total, hidden_size)), torch.empty((total,), dtype=torch.int32, device=x.device)
    dist.all_to_all_single(rows, send_rows[:total], group=group)
    dist.all_to_all_single(ids, send_ids[:total], group=group)
    if n_local:
        ones = torch.ones((total, 1), dtype=torch.float32, device=x.device)
        done = torch.ops.routemm.moe_experts(rows, ids[:, None], ones, gate_up, down, up, ggml_type, exact=exact)
    else:  # no rank sends here: every received row is padding
        done = torch.zeros_like(rows)
    back = torch.empty_like(done)
    dist.all_to_all_single(back, done, group=group)
    slot_rows = torch.cat([back, back.new_zeros((1, hidden_size))])[row].reshape(m, top_k, hidden_size)
    weights = top_k_weights.to(torch.float32)
    kept = kept.reshape(m, top_k)
    out = x.new_zeros((m, hidden_size))
    for s in range(top_k):  # the block's combine: slots in order, acc = fma(weight, row, acc)
        out = torch.where(kept[:, s, None], _fma_f32(weights[:, s, None], slot_rows[:, s], out), out)
    return out


__all__ = ["ExpertPlacement", "ep_capacity_dropped", "ep_moe_experts"]
