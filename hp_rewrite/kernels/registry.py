"""The expert-compute backends and the one rule that picks one (``runtime.compute``).

``grouped``: ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm``), forward and backward grouped;
``auto`` takes it on CPU and on CUDA sm90 / sm100 (elsewhere torch's fallback syncs the host at every
call: ``auto`` takes the per-expert loop there). Under autocast the problem's dtype is autocast's: the
runtime casts the operands as autocast casts a matmul's.
``eager``: a per-expert loop of matmuls (every device and dtype; the loop is the point).
``batched``: one batched matmul over a weight gathered per row, as transformers' ``batched_mm`` (every
device and dtype; no host value; memory grows with rows x weight size).
``npu``: ``torch_npu.npu_grouped_matmul`` and ``npu_swiglu`` (:mod:`.npu`); chosen whenever torch_npu
imports when asked for by name (also for CPU tensors: that is how it runs through a stand-in), and by
``auto`` on NPU devices. Its limits (groups, inner dimensions) fall back to ``grouped`` with the reason.

:func:`choose` returns a :class:`KernelChoice` naming the backend and why; an explicit request that
cannot run here comes back with ``backend=None`` and the reason, for the caller to raise.
:func:`compute_for` folds in the experts module's transformers ``experts_implementation``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F

from . import npu

COMPUTE_KINDS: tuple[str, ...] = ("auto", "grouped", "eager", "npu", "batched")


@dataclass(frozen=True)
class KernelProblem:
    """What the choice depends on: where the rows live, their dtype, the number of local experts and
    every weight dimension (each is the inner dimension of a forward or input-gradient GEMM)."""

    device_type: str
    dtype: torch.dtype
    groups: int
    dims: tuple[int, ...]
    weight_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class KernelChoice:
    requested: str
    backend: str | None  # None: the request cannot run here (``reason`` says why)
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def _grouped_problem(p: KernelProblem) -> str | None:
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return f"this torch ({torch.__version__}) has no grouped_mm"
    if p.weight_dtype is not None and p.weight_dtype != p.dtype:
        return f"rows are {p.dtype} but expert weights {p.weight_dtype}"
    if p.device_type == "cpu":
        ok = p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        return None if ok else f"torch grouped_mm on cpu takes fp32/bf16/fp16, not {p.dtype}"
    if p.device_type == "cuda":
        if p.dtype != torch.bfloat16:
            return f"torch grouped_mm on cuda takes bf16 only, not {p.dtype}"
        return None if torch.cuda.get_device_capability() >= (8, 0) else "torch grouped_mm needs sm80+"
    return f"torch grouped_mm does not run on {p.device_type}"


def _grouped_syncs(p: KernelProblem) -> str | None:
    """Why grouped_mm runs here but stalls the host (``auto`` then takes the per-expert loop), or None.

    Outside sm90 / sm100 (and on ROCm) torch's grouped_mm has no grouped kernel: its fallback copies the offsets to the host
    (a stream synchronisation per call, six per layer with the backward) and loops over the groups. The
    per-expert loop does the same GEMMs from split sizes the host already holds (ep > 1: the layer's one
    read), with no further sync."""
    if p.device_type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability()
    if torch.version.hip is not None:
        return (f"ROCm gfx (capability {major}.{minor}): torch grouped_mm has no grouped kernel there; it copies "
                "its offsets to the host at every call (a stream sync) and loops")
    if major not in (9, 10):
        return (f"sm{major}{minor}: torch grouped_mm has a grouped kernel on sm90 and sm100 only; elsewhere it "
                "copies its offsets to the host at every call (a stream sync) and loops")
    return None


def _npu_unusable(p: KernelProblem) -> str | None:
    """Why the npu ops cannot run at all here (an explicit ``npu`` request then fails)."""
    if not npu.available():
        return "torch_npu does not import here"
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"npu_grouped_matmul takes fp32/bf16/fp16, not {p.dtype}"
    return None


def _npu_problem(p: KernelProblem) -> str | None:
    return _npu_unusable(p) or npu.limits_problem(p.groups, p.dims)


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    problem: Callable[[KernelProblem], str | None]  # why it cannot run this problem here, None when it can


BACKENDS = MappingProxyType({
    "npu": Backend("npu", "torch_npu npu_grouped_matmul (m-grouped forward/dX, k-grouped dW) + npu_swiglu",
                   _npu_problem),
    "grouped": Backend("grouped", "torch grouped_mm (m-grouped forward/dX, k-grouped dW)", _grouped_problem),
    "eager": Backend("eager", "per-expert loop of matmuls", lambda p: None),
    "batched": Backend("batched", "torch bmm over one gathered weight per row (transformers' batched_mm)",
                       lambda p: None),
})

# transformers' ``experts_implementation`` -> the ``runtime.compute`` it asks for. ``grouped_mm`` is
# transformers' default, so it leaves the plan's choice (``auto`` picks grouped_mm where it runs).
_FROM_TRANSFORMERS = MappingProxyType({"eager": "eager", "batched_mm": "batched", "grouped_mm": None})


def compute_for(compute: str, experts_implementation: str | None) -> tuple[str, str | None]:
    """The ``runtime.compute`` that runs for the plan's ``compute`` and transformers'
    ``experts_implementation`` (``config.experts_implementation``, ``set_experts_implementation``), and
    why it cannot run (None when it can)."""
    if experts_implementation is None or experts_implementation == "grouped_mm":
        return compute, None
    if experts_implementation not in _FROM_TRANSFORMERS:
        return compute, (
            f"experts_implementation={experts_implementation!r} is a transformers kernel over all the experts of "
            "the unmodified module; an expert-parallel holder runs its local experts on the runtime's backends: "
            "use experts_implementation 'grouped_mm', 'eager' or 'batched_mm', or runtime.compute in the plan"
        )
    wanted = _FROM_TRANSFORMERS[experts_implementation]
    if compute not in ("auto", wanted):
        return compute, (
            f"experts_implementation={experts_implementation!r} asks for the {wanted} backend, the plan's "
            f"runtime.compute for {compute!r}: set one of them (runtime.compute: {wanted}, or leave "
            "experts_implementation at transformers' default)"
        )
    return wanted, None


def choose(requested: str, problem: KernelProblem) -> KernelChoice:
    """The backend that runs ``problem`` for ``runtime.compute: requested``, and why."""
    if requested not in COMPUTE_KINDS:
        return KernelChoice(requested, None, f"compute={requested!r}: choose one of {', '.join(COMPUTE_KINDS)}")
    where = f"{problem.dtype} on {problem.device_type}".replace("torch.", "")
    if requested in ("eager", "batched"):
        return KernelChoice(requested, requested, "requested")
    grouped_problem = _grouped_problem(problem)
    fallback = "grouped" if grouped_problem is None else "eager"
    if requested == "npu":
        why = _npu_problem(problem)
        if why is None:
            return KernelChoice(requested, "npu", f"requested; torch_npu imports ({where})")
        if _npu_unusable(problem):
            return KernelChoice(requested, None, f"compute=npu: {why}")
        return KernelChoice(requested, fallback, f"npu fallback: {why}" + (f"; {grouped_problem}" if grouped_problem
                                                                            else ""))
    if requested == "grouped":
        if grouped_problem is None:
            syncs = _grouped_syncs(problem)
            return KernelChoice(requested, "grouped", f"requested; grouped_mm runs {where}"
                                + (f" ({syncs})" if syncs else ""))
        if problem.device_type == "npu" and _npu_problem(problem) is None:
            return KernelChoice(requested, "npu", f"requested grouped; on npu that is npu_grouped_matmul ({where})")
        return KernelChoice(requested, None, f"compute=grouped: {grouped_problem}; use compute auto or eager")
    if problem.device_type == "npu":  # auto
        why = _npu_problem(problem)
        if why is None:
            return KernelChoice(requested, "npu", f"auto: npu device ({where})")
        return KernelChoice(requested, fallback, f"auto: npu unusable ({why})")
    if grouped_problem is None:
        syncs = _grouped_syncs(problem)
        if syncs:
            return KernelChoice(requested, "eager", f"auto: per-expert loop, no host sync of its own ({syncs})")
        return KernelChoice(requested, "grouped", f"auto: grouped_mm runs {where}")
    return KernelChoice(requested, "eager", f"auto: {grouped_problem}")
