"""Expert-parallel process groups and expert placement.

The groups come from a device mesh whose last dimension is ``ep`` (the user's, or
``("efsdp", "ep")`` built over the world): the world is split into EP groups of ``ep_size``
consecutive ranks. Within an EP group each rank owns
``num_experts / ep_size`` experts (consecutive ones unless the plan balances them, see
:class:`ExpertPlacement`). Ranks with the same position in different EP groups hold
replicas of the same experts: that second dimension is data parallel for the experts (its size is
``world_size / ep_size``).
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import ExpertParallelError

EP_DIM = "ep"  # the mesh dimension of the EP groups: the last one (consecutive ranks)
EXPERT_DP_DIMS = ("dp_replicate", "efsdp")  # mesh dimensions over which ranks hold the same experts
TP_DIM = "tp"  # the last dimension of the dense parts' mesh ("dp", "tp"): TP groups are consecutive ranks
CP_DIM = "cp"  # the last dimension of the context mesh ("dp", "cp"): context groups are consecutive ranks


@dataclass(frozen=True)
class ExpertParallelGroup:
    """This rank's view of the EP topology.

    group: the EP process group (None when ``size == 1``: no communication at all).
    replica_group: ranks holding the same experts (None when there is a single replica); expert
        gradients are averaged over it, non-expert gradients over the whole world.
    mesh: the device mesh the groups come from (``("efsdp", "ep")`` or ``("dp_replicate", "efsdp",
        "ep")``); None in a single process.
    tp_size, tp_rank, tp_group, tp_mesh: the tensor-parallel group (plan ``tp_size``) and the dense
        parts' mesh (``("dp", "tp")``). The ranks of a TP group share one batch; each routes and
        dispatches only its share of the tokens (:mod:`.tokens`), so no token is routed twice.
    cp_size, cp_rank, cp_group, cp_mesh: the context group (plan ``cp_size``) and its mesh (``("dp", "cp")``;
        with TP ``("dp", "cp", "tp")``: the context group strided over a block of ``cp x tp`` consecutive
        ranks, ``shared_group``, that holds one batch). Its ranks share one batch and each holds its share of every sequence (:mod:`hp_rewrite.context`),
        whose gradients reach the rest of the model scaled by ``cp_size``: to the runtime and the gradient
        contract a context rank is one more data-parallel rank, and the EP groups span context ranks as
        they span data-parallel ones.
    """

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    replica_size: int = 1
    replica_rank: int = 0
    replica_group: dist.ProcessGroup | None = None
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    tp_size: int = 1
    tp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    tp_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None
    cp_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    shared_group: dist.ProcessGroup | None = None

    @property
    def dp_size(self) -> int:
        """How many batches one step sees: the world over the TP size (gradients are means over them).
        Context ranks count as batches: their shares' gradients come scaled by ``cp_size``."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return world // self.tp_size

    @property
    def batch_ranks(self) -> int:
        """How many consecutive ranks hold one batch: a TP group's times a context group's."""
        return self.tp_size * self.cp_size

    @property
    def batch_group(self) -> dist.ProcessGroup | None:
        """The group of :attr:`batch_ranks` ranks holding one batch, or None when every rank holds its own."""
        if self.shared_group is not None:
            return self.shared_group
        return self.cp_group if self.cp_size > 1 else self.tp_group if self.tp_size > 1 else None

    def __deepcopy__(self, memo) -> ExpertParallelGroup:
        """Process groups are shared, not copied: a deep copy of a rewritten model (a frozen reference
        model, an EMA copy) runs over the same EP group."""
        return self

    @classmethod
    def single(cls) -> ExpertParallelGroup:
        """EP=1 in one process: the same routed code path, no collectives."""
        return cls()

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, ep_size: int | None = None) -> ExpertParallelGroup:
        """The EP and expert-replica groups of a device mesh whose last dimension is ``ep``.

        ``ep_size`` (the plan's) must equal that dimension; the EP groups must be consecutive ranks
        (what ``init_device_mesh`` makes of an ``ep`` dimension that comes last)."""
        ep_mesh = check_mesh(mesh, ep_size)
        size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
        names = tuple(mesh.mesh_dim_names)
        dp_dims = names[:-1]
        replicas = mesh[dp_dims[0]] if len(dp_dims) == 1 else mesh[dp_dims]._flatten("hp_expert_dp")
        return cls(
            size=size,
            rank=rank,
            group=ep_mesh.get_group() if size > 1 else None,
            replica_size=replicas.size(),
            replica_rank=replicas.get_local_rank(),
            replica_group=replicas.get_group() if replicas.size() > 1 else None,
            mesh=mesh,
        )

    @property
    def is_distributed(self) -> bool:
        return self.size > 1


def check_mesh(mesh: DeviceMesh, ep_size: int | None = None) -> DeviceMesh:
    """Validate a device mesh for expert parallelism and return its ``ep`` dimension: dimensions
    ``(["dp_replicate",] "efsdp", "ep")``, the whole world, ``ep`` of ``ep_size`` consecutive ranks."""
    names = tuple(mesh.mesh_dim_names or ())
    if not names or names[-1] != EP_DIM or any(n not in EXPERT_DP_DIMS for n in names[:-1]):
        raise ExpertParallelError(
            f"device mesh dimensions {names}: expected ('efsdp', 'ep') or ('dp_replicate', 'efsdp', 'ep'), "
            "with 'ep' last (the EP groups are consecutive ranks)"
        )
    return _consecutive_last(mesh, EP_DIM, "ep_size", ep_size)


def _consecutive_last(mesh: DeviceMesh, dim: str, field: str, size: int | None) -> DeviceMesh:
    """``mesh[dim]`` after checking that the mesh spans the world and that ``dim`` (its last) has the
    plan's ``size`` (``field``) over consecutive ranks."""
    if mesh.size() != dist.get_world_size():
        raise ExpertParallelError(
            f"the device mesh spans {mesh.size()} ranks, the world {dist.get_world_size()}: one mesh for all ranks"
        )
    sub = mesh[dim]
    if size is not None and sub.size() != size:
        raise ExpertParallelError(
            f"{field}={size} (the plan) but the device mesh's '{dim}' dimension has {sub.size()} ranks: "
            "make them equal"
        )
    first = dist.get_rank() - sub.get_local_rank()
    if sub.mesh.flatten().tolist() != list(range(first, first + sub.size())):
        raise ExpertParallelError(
            f"the device mesh's '{dim}' group of rank {dist.get_rank()} is {sub.mesh.flatten().tolist()}: "
            f"{dim.upper()} groups must be consecutive ranks; build the mesh with '{dim}' as its last dimension"
        )
    return sub


def backend_name(group: dist.ProcessGroup | None = None) -> str:
    """The backend string of ``group`` (the world by default), lower case: ``"gloo"``, ``"nccl"``, or a
    per-device list such as ``"cuda:nccl,cpu:gloo"`` (``init_process_group()`` without a backend).
    Test it with ``"nccl" in name``, never ``==``."""
    return str(dist.get_backend(group)).lower()


def mesh_device_type() -> str:
    """The device type of the world's backend: what a device mesh over it is built for."""
    backend = backend_name()
    if "nccl" in backend and torch.cuda.is_available():
        return "cuda"
    if "hccl" in backend:
        return "npu"
    return "cpu"


def world_timeout() -> timedelta | None:
    """The timeout the world was initialised with (``init_process_group(timeout=...)``, NCCL's 10 min
    by default). New groups do not inherit it (torch gives them its per-backend default), so the EP and
    TP groups are given it explicitly. None when the backend does not say."""
    world = dist.distributed_c10d._get_default_group()
    for device in world._device_types:
        try:
            return world._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def _options_like_world(timeout: timedelta):
    """Backend options for a new group: a copy of the world's own (NCCL's keep its stream priority and
    communicator config; a plugin such as HCCL gets its own options class) with ``timeout``; fresh ones
    where the world's cannot be copied (gloo's)."""
    world = dist.distributed_c10d._get_default_group()
    options = None
    try:
        options = copy.deepcopy(world._get_backend(torch.device(mesh_device_type())).options)
    except (AttributeError, RuntimeError, TypeError):
        pass
    if options is None:
        name = backend_name()
        if "nccl" in name and hasattr(dist, "ProcessGroupNCCL"):
            options = dist.ProcessGroupNCCL.Options()
        elif "gloo" in name:
            options = dist.ProcessGroupGloo._Options()
        else:
            options = torch._C._distributed_c10d.Backend.Options(name.split(",")[0].split(":")[-1])
    options._timeout = timeout
    return options


def _group_options(timeout_s: float | None, dims: tuple[str, ...], shape: tuple[int, ...]) -> dict | None:
    """Per mesh dimension, the options that give its groups their timeout (:func:`group_timeout`), one
    object each (a group's creation may change its options). None where nothing is to be set: a
    dimension of one rank, and one spanning the world when the plan sets no timeout (the mesh then
    reuses the world's own group, which has the world's timeout, instead of a second communicator)."""
    timeout = group_timeout(timeout_s)
    if timeout is None:
        return None
    world = dist.get_world_size()
    out = {d: _options_like_world(timeout) for d, n in zip(dims, shape, strict=True)
           if n > 1 and (n < world or timeout_s)}
    return out or None


def group_timeout(timeout_s: float | None) -> timedelta | None:
    """What the EP and TP groups wait for a collective: the plan's ``runtime.timeout_s`` when it sets
    one, else the world's own timeout. On NCCL and HCCL this is the watchdog's: a collective that takes
    longer aborts the job, so a short one kills a healthy run whose rank is still compiling or saving."""
    return timedelta(seconds=timeout_s) if timeout_s else world_timeout()


def expert_parallel_mesh(ep_size: int, timeout_s: float | None = None) -> DeviceMesh:
    """``("efsdp", "ep")`` over the initialised world: EP groups of ``ep_size`` consecutive ranks, and
    the ranks holding the same experts along ``efsdp``. Its groups wait ``timeout_s`` for a collective
    (:func:`group_timeout`: the world's own timeout when None)."""
    return _consecutive_mesh(("efsdp", EP_DIM), "ep_size", ep_size, timeout_s)


def _consecutive_mesh(dims: tuple[str, str], field: str, size: int, timeout_s: float | None) -> DeviceMesh:
    """A 2-D mesh over the initialised world whose last dimension is groups of ``size`` consecutive ranks."""
    world = dist.get_world_size()
    if world % size != 0:
        raise ExpertParallelError(
            f"{field}={size} does not divide the world size {world}: choose one that divides it "
            f"(e.g. {', '.join(str(d) for d in range(1, world + 1) if world % d == 0)})"
        )
    shape = (world // size, size)
    return init_device_mesh(mesh_device_type(), shape, mesh_dim_names=dims,
                            backend_override=_group_options(timeout_s, dims, shape))


def check_tp_mesh(mesh: DeviceMesh, tp_size: int) -> DeviceMesh:
    """Validate the dense parts' mesh: ``("dp", "tp")`` over the whole world, ``tp`` of ``tp_size``
    consecutive ranks (``dp`` is what gradients are averaged and ``fully_shard`` shards over)."""
    names = tuple(mesh.mesh_dim_names or ())
    if names != ("dp", TP_DIM):
        raise ExpertParallelError(
            f"device mesh dimensions {names}: with tp_size > 1 pass the dense parts' mesh, ('dp', 'tp') with "
            "'tp' last (the TP groups are consecutive ranks); the EP groups are cut from the same ranks"
        )
    _consecutive_last(mesh, TP_DIM, "tp_size", tp_size)
    return mesh


def tensor_parallel_mesh(tp_size: int, timeout_s: float | None = None) -> DeviceMesh:
    """``("dp", "tp")`` over the initialised world: TP groups of ``tp_size`` consecutive ranks."""
    return _consecutive_mesh(("dp", TP_DIM), "tp_size", tp_size, timeout_s)


def context_parallel_mesh(cp_size: int, timeout_s: float | None = None) -> DeviceMesh:
    """``("dp", "cp")`` over the initialised world: context groups of ``cp_size`` consecutive ranks."""
    return _consecutive_mesh(("dp", CP_DIM), "cp_size", cp_size, timeout_s)


def build_expert_parallel_group(ep_size: int, timeout_s: float | None = None,
                                mesh: DeviceMesh | None = None, tp_size: int = 1,
                                cp_size: int = 1) -> ExpertParallelGroup:
    """The EP and replica groups over the initialised default world, from ``mesh`` (the user's) or
    from :func:`expert_parallel_mesh`; with ``tp_size > 1`` also the TP group, from ``mesh`` (then the
    user's ``("dp", "tp")`` mesh of the dense parts) or from :func:`tensor_parallel_mesh`. EP groups are
    consecutive ranks too, so an EP group spans whole TP groups (the seed's TP-extended EP group) or
    a TP group whole EP groups. With ``cp_size > 1`` also the context group, from
    :func:`context_parallel_mesh` (the EP groups are cut from the world as without it).

    Every rank must call it (building a mesh is collective). Without a ``mesh`` the groups are built
    once per world and (``ep_size``, ``tp_size``, ``cp_size``, ``timeout_s``) and returned again to every later call
    (every model, every ``from_pretrained``): NCCL makes communicators per group, slow to create at
    scale and each holding device memory. Without ``torch.distributed`` initialised only
    ``ep_size == 1`` is possible.
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ExpertParallelError(f"ep_size={ep_size!r}: must be an integer >= 1")
    if not (dist.is_available() and dist.is_initialized()):
        if ep_size != 1 or mesh is not None or tp_size != 1 or cp_size != 1:
            which = (f"ep_size={ep_size}" + (f" with tp_size={tp_size}" if tp_size != 1 else "")
                     + (f" with cp_size={cp_size}" if cp_size != 1 else ""))
            raise ExpertParallelError(
                f"{which} needs torch.distributed initialised with a world size that is a "
                "multiple of it (launch with torchrun --nproc-per-node N), or use ep_size 1"
            )
        return ExpertParallelGroup.single()
    if mesh is None:  # one set of groups (NCCL communicators) per world and layout, for every model
        built = _BUILT.setdefault(dist.distributed_c10d._get_default_group(), {})
        key = (ep_size, tp_size, cp_size, timeout_s or None)
        if key not in built:
            built[key] = _with_context(_build(ep_size, None, tp_size, timeout_s), cp_size, timeout_s)
        return built[key]
    return _with_context(_build(ep_size, mesh, tp_size, timeout_s), cp_size, timeout_s)


def _with_context(ep: ExpertParallelGroup, cp_size: int, timeout_s: float | None) -> ExpertParallelGroup:
    """The context group. With TP groups too, a block of ``cp_size x tp_size`` consecutive ranks holds one
    batch: TP innermost (its groups stay consecutive), the context group strided by ``tp_size`` over the
    block, and the block itself the group that generates as one."""
    if cp_size == 1:
        return ep
    if ep.tp_size == 1:
        mesh = context_parallel_mesh(cp_size, timeout_s)
        cp = mesh[CP_DIM]
        return replace(ep, cp_size=cp_size, cp_rank=cp.get_local_rank(), cp_group=cp.get_group(), cp_mesh=mesh)
    block = cp_size * ep.tp_size
    whole = _consecutive_mesh(("dp", "batch"), "cp_size x tp_size", block, timeout_s)
    dims = ("dp", CP_DIM, TP_DIM)
    shape = (dist.get_world_size() // block, cp_size, ep.tp_size)
    mesh = init_device_mesh(mesh_device_type(), shape, mesh_dim_names=dims,
                            backend_override=_group_options(timeout_s, dims, shape))
    cp = mesh[CP_DIM]
    return replace(ep, cp_size=cp_size, cp_rank=cp.get_local_rank(), cp_group=cp.get_group(), cp_mesh=mesh,
                   shared_group=whole["batch"].get_group())


# The groups built for each world (keyed by its default process group, so a destroyed and re-initialised
# world builds its own): a cache of communicators, as torch keeps its groups, not a setting.
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _build(ep_size: int, mesh: DeviceMesh | None, tp_size: int, timeout_s: float | None) -> ExpertParallelGroup:
    if tp_size == 1:
        return ExpertParallelGroup.from_mesh(
            mesh if mesh is not None else expert_parallel_mesh(ep_size, timeout_s), ep_size)
    small, large = sorted((ep_size, tp_size))
    if large % small:
        raise ExpertParallelError(f"ep_size={ep_size} and tp_size={tp_size}: one must divide the other")
    dense = check_tp_mesh(mesh, tp_size) if mesh is not None else tensor_parallel_mesh(tp_size, timeout_s)
    tp = dense[TP_DIM]
    ep = ExpertParallelGroup.from_mesh(expert_parallel_mesh(ep_size, timeout_s), ep_size)
    return replace(ep, tp_size=tp_size, tp_rank=tp.get_local_rank(), tp_group=tp.get_group(), tp_mesh=dense)


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts live on which EP rank.

    Slot ``s`` (rank ``s // num_local``, local row ``s % num_local``) holds expert ``order[s]``. With no
    ``order`` rank r owns the consecutive experts ``[r * local, (r + 1) * local)``. A balanced ``order``
    (:meth:`balanced`) spreads a measured routing load evenly: which rank computes an expert never
    changes its result, only who waits for whom. Each rank's experts are kept ascending, so the local
    rows keep checkpoint order.
    """

    num_experts: int
    ep_size: int
    ep_rank: int
    order: tuple[int, ...] | None = None
    _tables: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ExpertParallelError(
                f"num_experts={self.num_experts}: a MoE layer needs at least one expert"
            )
        if self.num_experts % self.ep_size != 0:
            choices = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ExpertParallelError(
                f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}: "
                f"choose an ep_size among {choices}"
            )
        if not 0 <= self.ep_rank < self.ep_size:
            raise ExpertParallelError(f"ep_rank={self.ep_rank} outside [0, {self.ep_size})")
        if self.order is not None:
            if sorted(self.order) != list(range(self.num_experts)):
                raise ExpertParallelError(
                    f"expert order {list(self.order)} is not a permutation of 0..{self.num_experts - 1}"
                )
            if any(list(self.experts_of(r)) != sorted(self.experts_of(r)) for r in range(self.ep_size)):
                raise ExpertParallelError(
                    f"expert order {list(self.order)}: each rank's experts must be ascending"
                )
            if self.order == tuple(range(self.num_experts)):
                object.__setattr__(self, "order", None)  # one spelling of the contiguous placement

    @classmethod
    def balanced(cls, loads, ep_size: int, ep_rank: int) -> ExpertPlacement:
        """Spread experts so every rank gets ``E / ep_size`` of them and about the same total load.

        Heaviest expert first to the least loaded rank with room, then swaps between the busiest rank
        and another while they lower the busiest load. Ties go to lower ids, so every rank computes
        the same placement from the same loads; when nothing beats the contiguous placement, it is kept.
        """
        loads = [float(x) for x in loads]
        n = len(loads)
        contiguous = cls(n, ep_size, ep_rank)  # the divisibility and rank checks, before any work
        per = n // ep_size
        owned: list[list[int]] = [[] for _ in range(ep_size)]
        total = [0.0] * ep_size
        for e in sorted(range(n), key=lambda e: (-loads[e], e)):
            r = min((r for r in range(ep_size) if len(owned[r]) < per), key=lambda r: (total[r], r))
            owned[r].append(e)
            total[r] += loads[e]
        for _ in range(n * n):  # each swap lowers the sorted loads, so this ends; the cap is a guard
            b = max(range(ep_size), key=lambda r: (total[r], -r))
            best = None
            for r in range(ep_size):
                for e in owned[b]:
                    for f in owned[r]:
                        d = loads[e] - loads[f]
                        peak = max(total[b] - d, total[r] + d)
                        if d > 0 and peak < total[b] and (best is None or peak < best[0]):
                            best = (peak, r, e, f)
            if best is None:
                break
            _, r, e, f = best
            owned[b][owned[b].index(e)], owned[r][owned[r].index(f)] = f, e
            d = loads[e] - loads[f]
            total[b], total[r] = total[b] - d, total[r] + d
        if max(total) >= max(contiguous.rank_loads(loads)):
            return contiguous
        return cls(n, ep_size, ep_rank, tuple(e for group in owned for e in sorted(group)))

    @property
    def is_contiguous(self) -> bool:
        return self.order is None

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    def experts_of(self, rank: int) -> tuple[int, ...]:
        """The global ids of ``rank``'s experts, in local row order."""
        start = rank * self.num_local
        if self.order is None:
            return tuple(range(start, start + self.num_local))
        return self.order[start : start + self.num_local]

    @property
    def local_experts(self) -> tuple[int, ...]:
        return self.experts_of(self.ep_rank)

    @property
    def slot_of_expert(self) -> tuple[int, ...]:
        """Expert id -> slot (``rank * num_local + local row``): the dispatch sorts rows by slot."""
        if self.order is None:
            return tuple(range(self.num_experts))
        slots = [0] * self.num_experts
        for s, e in enumerate(self.order):
            slots[e] = s
        return tuple(slots)

    def slot_table(self, device: torch.device) -> torch.Tensor:
        """:attr:`slot_of_expert` on ``device``, plus ``num_experts -> num_experts`` (capacity's drop
        marker, which must keep sorting last). Built once per device: a host-to-device copy in every
        layer's dispatch would wait for the device."""
        key = str(device)
        if key not in self._tables:
            self._tables[key] = torch.tensor(
                (*self.slot_of_expert, self.num_experts), dtype=torch.int64, device=device
            )
        return self._tables[key]

    @property
    def local_index(self) -> slice | list[int]:
        """Index this rank's rows out of a full ``[num_experts, ...]`` tensor."""
        if self.order is None:
            return slice(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local)
        return list(self.local_experts)

    def rank_loads(self, loads) -> list[float]:
        """Total load per rank under this placement, for per-expert ``loads``."""
        return [sum(float(loads[e]) for e in self.experts_of(r)) for r in range(self.ep_size)]
