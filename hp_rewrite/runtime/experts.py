"""Local expert compute over the experts this rank owns, for every transformers weight layout.

The rows arrive grouped by local expert (``counts[e]`` rows for expert e, in order). The gate/up and
down projections run as grouped GEMMs (``torch.nn.functional.grouped_mm``, or ``npu_grouped_matmul``
on Ascend) or as a per-expert loop. The activation always comes from the experts module: its
``_apply_gate`` (clamped SwiGLU, gpt-oss alpha/limit, softcap, interleaved gate/up...) or its
``act_fn``; nothing here assumes silu.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import grouped_op, npu
from .deferred import DeferredGroupedMM, WeightGradQueue, refuse_hooked
from .errors import ExpertParallelError

# Parameter names of the supported layouts: (gate/up fused, up-only, separate gate, up, down).
_SEPARATE_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass(frozen=True)
class ExpertsLayout:
    """Where an experts holder keeps its weights and how to apply them.

    kind: ``fused`` (``gate_up_proj``, or ``up_proj`` when not gated, + ``down_proj``) or ``separate``
        (``gate_proj/up_proj/down_proj`` or ``w1/w3/w2``, each 3-D).
    transposed: weights stored ``[E, in, out]`` instead of ``[E, out, in]``.
    """

    kind: str
    up: str
    down: str
    gate: str | None = None
    gated: bool = True
    transposed: bool = False
    up_bias: str | None = None
    down_bias: str | None = None
    gate_bias: str | None = None
    post_norm: bool = False

    @property
    def weight_names(self) -> tuple[str, ...]:
        names = [n for n in (self.gate, self.up, self.down) if n]
        return tuple(names + [b for b in (self.gate_bias, self.up_bias, self.down_bias) if b])

    @classmethod
    def of(cls, module: nn.Module) -> ExpertsLayout:
        """Read the layout from the module's parameters and its ``use_experts_implementation`` flags."""
        params = dict(module.named_parameters(recurse=False))

        def bias(name: str) -> str | None:
            return f"{name}_bias" if f"{name}_bias" in params else None

        for gate, up, down in _SEPARATE_NAMES:
            if gate in params and up in params and down in params:
                transposed = getattr(module, "is_transposed", None)
                if transposed is None:
                    transposed = params[gate].shape[1] == params[down].shape[2] and not (
                        params[gate].shape[2] == params[down].shape[1]
                    )
                return cls(
                    "separate",
                    up,
                    down,
                    gate,
                    True,
                    bool(transposed),
                    bias(up),
                    bias(down),
                    bias(gate),
                    bool(getattr(module, "has_post_expert_norm", False)),
                )
        if "down_proj" not in params or not ({"gate_up_proj", "up_proj"} & params.keys()):
            raise ExpertParallelError(
                f"{type(module).__name__}: no expert weights found; expected 3-D gate_up_proj (or up_proj) + "
                f"down_proj, gate_proj/up_proj/down_proj or w1/w3/w2, got {sorted(params)}"
            )
        gated = bool(getattr(module, "has_gate", "gate_up_proj" in params))
        up = "gate_up_proj" if gated else "up_proj"
        if up not in params:
            raise ExpertParallelError(f"{type(module).__name__}: has_gate={gated} but no {up} parameter")
        transposed = getattr(module, "is_transposed", None)
        if transposed is None:  # undecorated holder: infer from shapes ([E,out,in] vs [E,in,out])
            transposed = params[up].shape[1] == params["down_proj"].shape[2] and not (
                params[up].shape[2] == params["down_proj"].shape[1]
            )
        return cls(
            "fused",
            up,
            "down_proj",
            None,
            gated,
            bool(transposed),
            bias(up),
            bias("down_proj"),
            None,
            bool(getattr(module, "has_post_expert_norm", False)),
        )


def holder_of(module: nn.Module) -> nn.Module | None:
    """The expert-parallel holder ``module`` is or wraps (PEFT's ``ParamWrapper`` keeps it as
    ``base_layer``, nested once per targeted parameter); None when it is neither."""
    seen = 0
    while module is not None and seen < 16:
        if getattr(module, "hp_expert_parallel", None) is not None:
            return module
        module = getattr(module, "base_layer", None)
        module = module if isinstance(module, nn.Module) else None
        seen += 1
    return None


@dataclass
class LocalBatch:
    """Rows for this rank's experts, grouped by local expert.

    counts: rows per local expert (host ints, known from the one split-size sync per layer).
    offsets: cumulative counts on the device (int32), as grouped GEMMs want them.
    """

    hidden: torch.Tensor
    counts: list[int]
    offsets: torch.Tensor
    compute: str = "auto"
    weight_grads: WeightGradQueue | None = None  # runtime.defer_expert_grads: where weight gradients queue

    @classmethod
    def from_counts(
        cls,
        hidden: torch.Tensor,
        counts: list[int],
        compute: str = "auto",
        weight_grads: WeightGradQueue | None = None,
    ) -> LocalBatch:
        offsets = (
            torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=hidden.device, dtype=torch.int32)
        )
        return cls(hidden, list(counts), offsets, compute, weight_grads)

    def row_experts(self) -> torch.Tensor:
        """Local expert id of every row (only needed for per-expert biases)."""
        n = self.hidden.shape[0]
        rows = torch.arange(n, device=self.hidden.device, dtype=torch.int32)
        return torch.searchsorted(self.offsets, rows, right=True)


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``) runs for this device/dtype."""
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype != weight.dtype:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return False


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _grouped_mm(x: torch.Tensor, w_in_out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # traceable for every dtype (see grouped_op)
        return grouped_op.grouped_mm(x, w_in_out, offsets)
    mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    out = mm(x, w_in_out, offs=offsets)
    if out.requires_grad:  # grouped_mm's backward rejects expanded gradients (a hook, not a view of out:
        out.register_hook(_contiguous)  # FSDP2 warns when a module returns a view)
    return out


def _project(
    batch: LocalBatch,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transposed: bool,
    kind: str,
    row_experts: torch.Tensor | None,
    name: str,
) -> torch.Tensor:
    """``x_e @ W_e (+ b_e)`` for every local expert e over its rows."""
    w_in_out = weight if transposed else weight.transpose(1, 2)
    # deferred gradients go into a parameter's .grad: a computed weight (a PEFT adapter's W + BA)
    # takes the plain path, whose autograd carries the gradient to the adapter
    deferred = batch.weight_grads is not None and weight.requires_grad and weight.is_leaf and torch.is_grad_enabled()
    if kind == "npu":
        out = npu.grouped_matmul(x, w_in_out, batch.counts)
    elif kind == "grouped" and deferred:
        refuse_hooked(weight, name)
        out = DeferredGroupedMM.apply(
            x, w_in_out.detach(), batch.offsets, batch.counts, weight, transposed, batch.weight_grads
        )
    elif kind == "grouped":
        out = _grouped_mm(x, w_in_out, batch.offsets)
    else:
        pieces = [xe @ we for xe, we in zip(x.split(batch.counts), w_in_out.unbind(0), strict=True)]
        out = torch.cat(pieces) if pieces else x.new_empty((0, w_in_out.shape[-1]))
    if bias is not None:
        out = out + bias.index_select(0, row_experts)
    return out


def resolve_compute(requested: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    """Map ``auto|grouped|eager`` to the kernel that runs here: ``npu``, ``grouped`` or ``eager``."""
    if requested == "eager":
        return "eager"
    if x.device.type == "npu" and npu.available():
        return "npu"
    if grouped_mm_supported(x, weight):
        return "grouped"
    if requested == "grouped":
        raise ExpertParallelError(
            f"compute=grouped: no grouped GEMM for {x.dtype} on {x.device.type} here; use compute auto or eager"
        )
    return "eager"


def local_experts_forward(
    module: nn.Module, batch: LocalBatch, layout: ExpertsLayout | None = None
) -> torch.Tensor:
    """Unweighted expert MLP outputs ``[N, H]`` for rows grouped by local expert."""
    layout = layout or ExpertsLayout.of(module)
    x = batch.hidden
    up = getattr(module, layout.up)
    kind = resolve_compute(batch.compute, x, up)
    has_bias = layout.up_bias or layout.down_bias or layout.gate_bias
    rows = batch.row_experts() if has_bias else None

    def bias(name: str | None) -> torch.Tensor | None:
        return getattr(module, name) if name else None

    owner = type(module).__name__  # names a weight in errors

    if layout.kind == "separate":
        g = _project(
            batch, x, getattr(module, layout.gate), bias(layout.gate_bias), layout.transposed, kind, rows,
            f"{owner}.{layout.gate}",
        )
        u = _project(batch, x, up, bias(layout.up_bias), layout.transposed, kind, rows, f"{owner}.{layout.up}")
        if hasattr(module, "_apply_gate"):
            h = module._apply_gate(torch.cat([g, u], dim=-1))
        else:
            h = module.act_fn(g) * u
    else:
        h = _project(batch, x, up, bias(layout.up_bias), layout.transposed, kind, rows, f"{owner}.{layout.up}")
        if layout.gated:
            h = module._apply_gate(h) if hasattr(module, "_apply_gate") else _default_gate(module, h)
        else:
            h = module.act_fn(h)
    y = _project(
        batch, h, getattr(module, layout.down), bias(layout.down_bias), layout.transposed, kind, rows,
        f"{owner}.{layout.down}",
    )
    if layout.post_norm:
        y = module.post_expert_norm(y)
    return y


def _default_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def shard_experts(module: nn.Module, num_experts: int, keep) -> None:
    """Keep only the experts ``keep`` (global ids, in local row order) in the holder's per-expert parameters.

    Used when a full module was built (tests, EP=1 -> EP=n); the loader reads only local experts instead.
    """
    keep = list(keep)
    layout = ExpertsLayout.of(module)
    for name in layout.weight_names:
        p = getattr(module, name)
        if p.shape[0] != num_experts:
            raise ExpertParallelError(
                f"{type(module).__name__}.{name} has {p.shape[0]} rows in dim 0, expected num_experts={num_experts}"
            )
        rows = p.detach()[keep[0] : keep[-1] + 1] if keep == list(range(keep[0], keep[-1] + 1)) else p.detach()[keep]
        setattr(module, name, nn.Parameter(rows.clone(), requires_grad=p.requires_grad))
    if hasattr(module, "num_experts"):
        module.num_experts = len(keep)
