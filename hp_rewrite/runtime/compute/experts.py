"""Local expert compute over the experts this rank owns, for every transformers weight layout.

The rows arrive grouped by local expert (``counts[e]`` rows for expert e, in order). The gate/up and
down projections run on the backend :mod:`hp_rewrite.kernels` chooses (from ``runtime.compute`` and
the holder's transformers ``experts_implementation``): grouped GEMMs
(``torch.nn.functional.grouped_mm``), a batched matmul over per-row weights, torch_npu's
``npu_grouped_matmul`` (+ ``npu_swiglu``) as one autograd function for the whole MLP, or a per-expert
loop. The activation always comes from the experts module: its
``_apply_gate`` (clamped SwiGLU, gpt-oss alpha/limit, softcap, interleaved gate/up...) or its
``act_fn``; nothing here assumes silu.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ... import kernels
from ...kernels import KernelChoice, KernelProblem, npu, torch_grouped
from .. import installed
from ..errors import ExpertParallelError
from ..overlap.deferred import DeferredGroupedMM, grouped_grad_sink, refuse_hooked
from . import expert_modules, grouped_op, quantized
from .batch import LocalBatch, pad_empty_groups
from .stacked import StackedParams, stacked_grouped_mm

# Parameter names of the supported layouts: (gate/up fused, up-only, separate gate, up, down).
_SEPARATE_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# (gate, up, down) names of flat 2-D expert weights kept in a child of the holder (DBRX's mlp.w1/v1/w2)
_FLAT_NAMES = (*_SEPARATE_NAMES, ("w1", "v1", "w2"))


@dataclass(frozen=True, kw_only=True)
class ExpertsLayout:
    """Where an experts holder keeps its weights and how to apply them.

    kind: ``fused`` (``gate_up_proj``, or ``up_proj`` when not gated, + ``down_proj``) or ``separate``
        (``gate_proj/up_proj/down_proj`` or ``w1/w3/w2``, each 3-D).
    transposed: weights stored ``[E, in, out]`` instead of ``[E, out, in]``.
    flat: rows per expert of flat 2-D weights ``[E * flat, C]`` (E blocks ``[flat, C]`` stacked along
        dim 0), whose names are paths below the holder (``mlp.w1``); 0 for 3-D ``[E, ...]`` weights.
    down_transposed: the down projection's own orientation when it differs from ``transposed`` (flat
        layouts: ``[I, H]`` blocks are read as ``x @ W.T`` by gate/up and as ``h @ W`` by down).
    zero_experts: rows of the up weight beyond down's experts: ids ``>= num_experts`` are identity experts
        (``w * x``), computed on the sending rank and never dispatched (:mod:`.zero_experts`).
    expert_keys: experts held as modules (:mod:`.expert_modules`): the container's keys of all experts,
        in expert-id order; the role names (gate, up, down, biases) are then paths below one expert
        (``w1.weight``), stacked over the held experts by :meth:`weight`. Empty for 3-D layouts.
    held_keys: the keys this rank holds (set when the holder is sharded); None: all of them.
    module_act: the experts' activation, ``("attr", name)`` or ``("fn", name)`` (:mod:`.expert_modules`).
    split: the 3-D weights live in two children of the holder (JetMoE's ``input_linear.weight`` and
        ``output_linear.weight``; names are paths), and the holder is the MoE block itself, which also
        holds its router (:meth:`split_of`).
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
    flat: int = 0
    down_transposed: bool | None = None
    zero_experts: int = 0
    expert_keys: tuple[str, ...] = ()
    held_keys: tuple[str, ...] | None = None
    module_act: tuple[str, str] | None = None
    split: bool = False

    @property
    def modules(self) -> bool:
        """The experts are modules of a ModuleList / ModuleDict, not rows of 3-D weights."""
        return bool(self.expert_keys)

    @property
    def roles(self) -> tuple[str, ...]:
        """The weights the computation reads (:meth:`weight` gives each as ``[E, ., .]``)."""
        names = [n for n in (self.gate, self.up, self.down) if n]
        return tuple(names + [b for b in (self.gate_bias, self.up_bias, self.down_bias) if b])

    @property
    def weight_names(self) -> tuple[str, ...]:
        """The expert parameters' names below the holder: :attr:`roles`, or for experts held as modules
        every held expert's (``3.w1.weight``)."""
        if self.modules:
            return tuple(f"{k}.{r}" for k in self.held for r in self.roles)
        return self.roles

    @property
    def held(self) -> tuple[str, ...]:
        return self.expert_keys if self.held_keys is None else self.held_keys

    @property
    def padded_names(self) -> tuple[str, ...]:
        """Weights whose dim 0 holds the zero (identity) experts' rows after the routed experts' (LongCat's
        ``gate_up_proj``): the forward never reads those rows, every rank keeps them (save/load round-trip)."""
        return tuple(n for n in (self.up, self.up_bias) if n) if self.zero_experts else ()

    def rows_of(self, name: str, experts, num_experts: int) -> tuple[int, ...]:
        """Global dim-0 rows of weight ``name`` on a rank holding ``experts`` of ``num_experts`` routed ones."""
        tail = range(num_experts, num_experts + self.zero_experts) if name in self.padded_names else ()
        return (*experts, *tail)

    def transposed_of(self, name: str) -> bool:
        """Whether weight ``name`` is stored ``[in, out]`` per expert."""
        if name == self.down and self.down_transposed is not None:
            return self.down_transposed
        return self.transposed

    def param(self, module: nn.Module, name: str) -> torch.Tensor:
        """The stored weight ``name`` (a path below the holder for flat layouts)."""
        owner, leaf = self.owner_of(module, name)
        return getattr(owner, leaf)

    def owner_of(self, module: nn.Module, name: str) -> tuple[nn.Module, str]:
        """The module that holds weight ``name`` and the weight's attribute name on it."""
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        if owner_path and hasattr(owner, "base_layer"):
            # PEFT wrapped the child: its adapter applies only inside the child's own forward, which the
            # expert-parallel holder never calls; reading through would drop it
            raise ExpertParallelError(
                f"{type(module).__name__}.{owner_path} is wrapped by {type(owner).__name__} (an adapter on the "
                f"expert weight {name}): the expert-parallel experts read {name} directly and would skip "
                "the adapter. Put adapters on other modules (e.g. attention via target_modules), or run this "
                "model data-parallel"
            )
        return owner, leaf

    def set_param(self, module: nn.Module, name: str, value: nn.Parameter) -> None:
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, value)

    def per_expert(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a weight, its gradient, a checkpoint tensor) with dim 0 = experts: flat ``[E*R, C]``
        viewed as ``[E, R, C]``, a 3-D weight as it is."""
        return t.unflatten(0, (-1, self.flat)) if self.flat else t

    def stored(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`per_expert`: ``[E, R, C]`` back to the stored flat ``[E*R, C]``."""
        return t.flatten(0, 1) if self.flat else t

    def weight(self, module: nn.Module, name: str) -> torch.Tensor:
        """Weight ``name`` of ``module`` as ``[E, ., .]`` for the grouped GEMMs (experts held as modules:
        the held experts' weights stacked, a differentiable copy)."""
        if self.modules:
            return torch.stack([self.param(module, f"{k}.{name}") for k in self.held])
        return self.per_expert(self.param(module, name))

    def expert_shape(self, module: nn.Module, name: str) -> torch.Size:
        """The shape of one expert's part of weight ``name`` (without stacking experts held as modules)."""
        if self.modules:
            return self.param(module, f"{self.held[0]}.{name}").shape
        return self.weight(module, name).shape[1:]

    def activation(self, module: nn.Module):
        """The act_fn of the holder, or of the child holding flat weights (DBRX's ``activation_fn``), or
        of the experts held as modules."""
        if self.modules:
            return expert_modules.activation_of(module.get_submodule(self.held[0]), self.module_act)
        owner = self.param(module, self.up.rpartition(".")[0]) if self.flat and "." in self.up else module
        names = ("act_fn", "activation_fn", "activation") if self.split else ("act_fn", "activation_fn")
        return next(getattr(m, a) for m in (module, owner) for a in names if callable(getattr(m, a, None)))

    @classmethod
    def split_of(cls, module: nn.Module) -> ExpertsLayout | None:
        """The layout of a block holding its experts' 3-D weights in two children, one ``weight`` each
        (JetMoE: ``input_linear.weight [E, 2I, H]``, ``output_linear.weight [E, H, I]``, read as ``x @ W_e.T``;
        a fused gate/up when the first is twice the second's width), with a callable ``activation``;
        None otherwise."""
        held = []
        for name, child in module.named_children():
            params = dict(child.named_parameters())
            w = params.get("weight")
            if len(params) == 1 and w is not None and w.dim() == 3 and w.shape[0] >= 2 and w.is_floating_point():
                held.append((name, w))
        if len(held) != 2 or held[0][1].shape[0] != held[1][1].shape[0]:
            return None
        (up, w_up), (down, w_down) = held
        hidden, width = w_down.shape[1], w_down.shape[2]
        if w_up.shape[2] != hidden or w_up.shape[1] not in (width, 2 * width):
            return None
        if not any(callable(getattr(module, a, None)) for a in ("act_fn", "activation_fn", "activation")):
            return None
        return cls(kind="fused", up=f"{up}.weight", down=f"{down}.weight", gated=w_up.shape[1] == 2 * width,
                   split=True)

    @classmethod
    def flat_of(cls, module: nn.Module) -> ExpertsLayout | None:
        """The layout of a holder (an int ``num_experts``) whose expert weights are flat 2-D ``[E*R, C]``
        tensors of one shape in a direct child (gate, up, down; no biases), its only parameters; None
        otherwise. One shape for all three means gate/up read ``x @ W_e.T`` and down ``h @ W_e`` (W_e
        ``[R, C]``, C = hidden)."""
        n = getattr(module, "num_experts", None)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or len(list(module.parameters())) != 3:
            return None
        for prefix, child in module.named_children():
            params = dict(child.named_parameters(recurse=False))
            for names in _FLAT_NAMES:
                weights = [params.get(x) for x in names]
                if any(w is None or w.dim() != 2 for w in weights) or len({tuple(w.shape) for w in weights}) != 1:
                    continue
                rows = weights[0].shape[0]
                if rows % n or rows == n:
                    continue
                gate, up, down = (f"{prefix}.{x}" for x in names)
                return cls(kind="separate", up=up, down=down, gate=gate, flat=rows // n, down_transposed=True)
        return None

    @classmethod
    def modules_of(cls, module: nn.Module) -> ExpertsLayout | None:
        """The layout of a ModuleList / ModuleDict of per-expert MLPs (:func:`.expert_modules.roles_of`)."""
        r = expert_modules.roles_of(module)
        if r is None:
            return None
        w = lambda n: f"{n}.weight"  # noqa: E731
        b = lambda n, has: f"{n}.bias" if has else None  # noqa: E731
        return cls(kind="separate" if r.gate else "fused", up=w(r.up), down=w(r.down),
                   gate=w(r.gate) if r.gate else None, gated=r.gate is not None, up_bias=b(r.up, r.up_bias),
                   down_bias=b(r.down, r.down_bias), gate_bias=b(r.gate, r.gate_bias) if r.gate else None,
                   expert_keys=r.keys, module_act=r.activation)

    @classmethod
    def of(cls, module: nn.Module) -> ExpertsLayout:
        """Read the layout from the module's parameters and its ``use_experts_implementation`` flags."""
        if not any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            split = cls.split_of(module)
            if split is not None:
                return split
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            layout = cls.modules_of(module)
            if layout is None:
                raise ExpertParallelError(
                    f"{type(module).__name__}: not a list of experts of one class, each a gated or plain MLP "
                    "of nn.Linear projections")
            return layout
        params = dict(module.named_parameters(recurse=False))
        if not params:
            flat = cls.flat_of(module)
            if flat is not None:
                return flat

        def bias(name: str) -> str | None:
            return f"{name}_bias" if f"{name}_bias" in params else None

        for gate, up, down in _SEPARATE_NAMES:
            if gate in params and up in params and down in params:
                return cls(kind="separate", up=up, down=down, gate=gate,
                           transposed=_transposed(module, params[gate], params[down]), up_bias=bias(up),
                           down_bias=bias(down), gate_bias=bias(gate),
                           post_norm=bool(getattr(module, "has_post_expert_norm", False)))
        if "down_proj" not in params or not ({"gate_up_proj", "up_proj"} & params.keys()):
            raise ExpertParallelError(
                f"{type(module).__name__}: no expert weights found; expected 3-D gate_up_proj (or up_proj) + "
                f"down_proj, gate_proj/up_proj/down_proj or w1/w3/w2, got {sorted(params)}"
            )
        gated = bool(getattr(module, "has_gate", "gate_up_proj" in params))
        up = "gate_up_proj" if gated else "up_proj"
        if up not in params:
            raise ExpertParallelError(f"{type(module).__name__}: has_gate={gated} but no {up} parameter")
        return cls(kind="fused", up=up, down="down_proj", gated=gated,
                   transposed=_transposed(module, params[up], params["down_proj"]), up_bias=bias(up),
                   down_bias=bias("down_proj"), post_norm=bool(getattr(module, "has_post_expert_norm", False)),
                   zero_experts=max(0, params[up].shape[0] - params["down_proj"].shape[0]))


def _transposed(module: nn.Module, first: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether 3-D expert weights are stored ``[E, in, out]``, decided once per holder: the
    ``is_transposed`` flag transformers' experts decorator sets, else (an undecorated holder) from the
    shapes of the first projection and down (``[E, out, in]`` vs ``[E, in, out]``)."""
    flag = getattr(module, "is_transposed", None)
    if flag is not None:
        return bool(flag)
    return first.shape[1] == down.shape[2] and not first.shape[2] == down.shape[1]


def holder_of(module: nn.Module) -> nn.Module | None:
    """The expert-parallel holder ``module`` is or wraps, the one place PEFT's wrappers are seen
    through: a ``ParamWrapper`` or LoRA layer keeps it as ``base_layer`` (nested once per targeted
    parameter), a ``ModulesToSaveWrapper`` as ``original_module`` (its trained copy beside it is
    refused by name where state dicts are taken); None when it is neither."""
    seen = 0
    while module is not None and seen < 16:
        if installed.binding(module) is not None:
            return module
        module = wrapped(module)[1]
        seen += 1
    return None


def wrapped(module: nn.Module) -> tuple[str, nn.Module | None]:
    """``(attribute, module)`` that a PEFT wrapper wraps: ``base_layer`` or ``original_module``; ``("", None)``
    for any other module."""
    for attr in ("base_layer", "original_module"):
        inner = getattr(module, attr, None)
        if isinstance(inner, nn.Module):
            return attr, inner
    return "", None


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``) runs for this device/dtype."""
    return kernels.choose("grouped", _problem(x, weight.shape[0], tuple(weight.shape[1:]), weight.dtype)).backend \
        == "grouped"


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _grouped_mm(x: torch.Tensor, w_in_out: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # traceable for every dtype (see grouped_op)
        return grouped_op.grouped_mm(x, w_in_out, offsets)
    mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    if torch_grouped.needs_alignment(x, w_in_out):  # grouped_mm wants 16-byte row strides
        xa, wa, width = torch_grouped.aligned(x, w_in_out)
        out = mm(xa, wa, offs=offsets)[:, :width]
    else:
        out = mm(x, w_in_out, offs=offsets)
    if out.requires_grad:  # grouped_mm's backward rejects expanded gradients (a hook, not a view of out:
        out.register_hook(_contiguous)  # FSDP2 warns when a module returns a view)
    return out


def _deferred(batch: LocalBatch, weight: torch.Tensor) -> bool:
    """Whether this weight's gradient goes to the deferred queue. Deferred gradients go into a
    parameter's .grad: a computed weight (a PEFT adapter's W + BA) takes the plain path, whose
    autograd carries the gradient to the adapter."""
    return batch.weight_grads is not None and weight.requires_grad and weight.is_leaf and torch.is_grad_enabled()


def _npu_sink(batch: LocalBatch, weight: torch.Tensor, transposed: bool, name: str):
    if not _deferred(batch, weight):
        return None
    refuse_hooked(weight, name)
    return grouped_grad_sink(batch.weight_grads, weight, transposed)


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
    if isinstance(weight, quantized.QuantizedProjection):  # experts kept as codes and scales
        return _project_quantized(batch, x, weight, bias, kind, row_experts)
    if isinstance(weight, StackedParams):  # experts held as modules
        if kind == "grouped" and not torch.compiler.is_compiling() and not torch_grouped.needs_alignment(
                x, weight.params[0] if transposed else weight.params[0].t()):
            out = stacked_grouped_mm(x, weight, batch.offsets, transposed)  # no stacked copy kept for backward
            return out if bias is None else out + bias.index_select(0, row_experts)
        weight = weight.stacked()
    w_in_out = weight if transposed else weight.transpose(1, 2)
    deferred = _deferred(batch, weight)
    if kind == "npu":
        sink = _npu_sink(batch, weight, transposed, name)
        out = npu.grouped_matmul(x, w_in_out.detach() if sink else w_in_out, batch.counts, defer=sink,
                                 ends=batch.offsets.long())
    elif kind == "grouped" and deferred:
        refuse_hooked(weight, name)
        out = DeferredGroupedMM.apply(
            x, w_in_out.detach(), batch.offsets, batch.counts, weight, transposed, batch.weight_grads
        )
    elif kind == "grouped":
        out = _grouped_mm(x, w_in_out, batch.offsets)
    elif kind == "batched":  # transformers' batched_mm: each row times its expert's weight, one bmm
        out = torch.bmm(x.unsqueeze(1), w_in_out.index_select(0, row_experts)).squeeze(1)
    else:
        pieces = [xe @ we for xe, we in zip(x.split(batch.counts), w_in_out.unbind(0), strict=True)]
        out = torch.cat(pieces) if pieces else x.new_empty((0, w_in_out.shape[-1]))
    if bias is not None:
        out = out + bias.index_select(0, row_experts)
    return out


def _project_quantized(batch, x, weight, bias, kind, row_experts) -> torch.Tensor:
    kind = "grouped" if kind == "grouped" else "eager"  # decoded chunks: grouped_mm, else one matmul per expert

    def low_rank(rows: torch.Tensor, w_in_out: torch.Tensor) -> torch.Tensor:  # the LoRA factors' products
        unaligned = torch.compiler.is_compiling() and torch_grouped.needs_alignment(rows, w_in_out)
        return _project(batch, rows, w_in_out, None, True, "eager" if unaligned else kind, None, weight.name)

    out = quantized.quantized_project(weight, x, lambda: batch.counts, batch.offsets if kind == "grouped" else None,
                                      _grouped_mm if kind == "grouped" else None, low_rank)
    return out if bias is None else out + bias.index_select(0, row_experts)


def _problem(x: torch.Tensor, groups: int, dims: tuple[int, ...], weight_dtype: torch.dtype) -> KernelProblem:
    return KernelProblem(x.device.type, x.dtype, groups, tuple(dims), weight_dtype)


def experts_implementation_of(module: nn.Module) -> str | None:
    """transformers' ``experts_implementation`` of an experts holder (its ``config``; what
    ``from_pretrained(experts_implementation=...)`` and ``set_experts_implementation`` change); None
    for a holder without one (remote code, older classes)."""
    config = getattr(module, "config", None)
    value = getattr(config, "_experts_implementation", None) if config is not None else None
    return value if isinstance(value, str) else None


def kernel_choice(requested: str, module: nn.Module, device_type: str, dtype: torch.dtype,
                  layout: ExpertsLayout | None = None, weight_dtype: torch.dtype | None = None,
                  weights: dict[str, torch.Tensor] | None = None) -> KernelChoice:
    """The backend (:mod:`hp_rewrite.kernels`) that runs this holder's experts on ``dtype`` rows on
    ``device_type`` for ``runtime.compute: requested`` and the holder's ``experts_implementation``, and
    why (the report and ``describe-moe`` show it). ``weight_dtype`` overrides the weights' own dtype (a
    model built on meta in another dtype than it will run in); ``weights``: the layout's weights as
    :meth:`ExpertsLayout.weight` gives them, when the caller has them already."""
    implementation = experts_implementation_of(module)
    compute, problem = kernels.compute_for(requested, implementation)
    if problem is not None:
        return KernelChoice(requested, None, f"{type(module).__name__}: {problem}")
    layout = layout or ExpertsLayout.of(module)
    weights = [weights[n] if weights else _weight_of(module, layout, n) for n in (layout.gate, layout.up, layout.down)
               if n]
    dims = tuple(sorted({d for w in weights for d in w.shape[1:]}))
    problem = KernelProblem(device_type, dtype, weights[0].shape[0], dims, weight_dtype or weights[0].dtype)
    choice = kernels.choose(compute, problem)
    if compute != requested:
        return KernelChoice(requested, choice.backend, f"experts_implementation={implementation!r}: {choice.reason}")
    return choice


def resolve_compute(requested: str, x: torch.Tensor, weight: torch.Tensor) -> str:
    """Map ``auto|grouped|eager|npu`` to the kernel that runs here: ``npu``, ``grouped`` or ``eager``."""
    choice = kernels.choose(requested, _problem(x, weight.shape[0], tuple(weight.shape[1:]), weight.dtype))
    if choice.backend is None:
        raise ExpertParallelError(choice.reason)
    return choice.backend


def plain_swiglu(module: nn.Module, layout: ExpertsLayout) -> bool:
    """A fused ``[gate | up]`` projection activated as ``silu(gate) * up`` (what ``npu_swiglu`` computes)."""
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation" or act is F.silu
    gate = getattr(type(module), "_apply_gate", None)  # transformers' default gate is chunk(2) + act_fn
    default = gate is None or (getattr(gate, "__name__", "") == "_default_apply_gate"
                               and getattr(gate, "__module__", "") == "transformers.integrations.moe")
    return layout.gated and silu and default


def _gate_of(module: nn.Module, layout: ExpertsLayout, kind: str):
    """The activation between the two projections: ``npu_swiglu`` where it is exact, else the module's own."""
    if kind == "npu" and plain_swiglu(module, layout):
        return npu.npu_swiglu
    if not layout.gated:
        return layout.activation(module)
    if hasattr(module, "_apply_gate"):
        return module._apply_gate
    return functools.partial(_default_gate, layout.activation(module))


def local_experts_forward(
    module: nn.Module, batch: LocalBatch, layout: ExpertsLayout | None = None, weights: dict | None = None
) -> torch.Tensor:
    """Unweighted expert MLP outputs ``[N, H]`` for rows grouped by local expert (``weights``: other
    experts' stacked weights by name, run with the module's activation: lent ones, runtime.balance)."""
    layout = layout or ExpertsLayout.of(module)
    if layout.modules and module.training:
        expert_modules.refuse_training_dropout(module, layout.held)
    x = batch.hidden
    weights = weights or local_weights(module, layout, batch.fp8_gemm)
    amp = _autocast_dtype(x)
    choice = kernel_choice(batch.compute, module, x.device.type, amp or x.dtype, layout, weights=weights,
                           weight_dtype=amp)
    if choice.backend is None:
        raise ExpertParallelError(choice.reason)
    kind = choice.backend
    if kind == "grouped" and x.shape[0] == 0:  # no rows: empty matmuls keep the graph (and the exchange's
        kind = "eager"  # backward) connected; grouped_mm is never called with no work
    elif kind == "grouped":
        padded = pad_empty_groups(batch, always=x.device.type == "cuda")  # empty groups: a zero row (.batch)
        if padded is not None:
            return local_experts_forward(module, padded[0], layout, weights).index_select(0, padded[1])
    if amp is not None and kind in ("grouped", "npu"):  # their ops are not on autocast's list: cast as for a matmul
        x = x.to(amp)
        weights = {n: w if w.dtype == amp else w.to(amp) for n, w in weights.items()}
    if kind != "grouped":  # only grouped_mm reads experts held as modules without stacking them
        weights = {n: w.stacked() if isinstance(w, StackedParams) else w for n, w in weights.items()}
    up = weights[layout.up]
    if layout.zero_experts:  # the zero experts' rows after the local ones are never computed
        up = up[: batch.num_groups]
    has_bias = layout.up_bias or layout.down_bias or layout.gate_bias
    owner = type(module).__name__  # names a weight in errors
    kept = any(isinstance(w, quantized.QuantizedProjection) for w in weights.values())  # experts as codes
    if kind == "npu" and layout.kind == "fused" and not has_bias and not kept:  # the MLP as one autograd function
        down = weights[layout.down]
        w_up = up if layout.transposed else up.transpose(1, 2)
        w_down = down if layout.transposed else down.transpose(1, 2)
        sinks = (_npu_sink(batch, up, layout.transposed, f"{owner}.{layout.up}"),
                 _npu_sink(batch, down, layout.transposed, f"{owner}.{layout.down}"))
        y = npu.grouped_swiglu(x, w_up.detach() if sinks[0] else w_up, w_down.detach() if sinks[1] else w_down,
                               batch.counts, activation=_gate_of(module, layout, kind), defer=sinks,
                               ends=batch.offsets.long())
        return module.post_expert_norm(y) if layout.post_norm else y
    rows = batch.row_experts() if has_bias or kind == "batched" else None

    def bias(name: str | None) -> torch.Tensor | None:
        return weights[name] if name else None

    gate = _gate_of(module, layout, kind)
    if layout.kind == "separate":
        g = _project(
            batch, x, weights[layout.gate], bias(layout.gate_bias), layout.transposed, kind, rows,
            f"{owner}.{layout.gate}",
        )
        u = _project(batch, x, up, bias(layout.up_bias), layout.transposed, kind, rows, f"{owner}.{layout.up}")
        if hasattr(module, "_apply_gate") or gate is npu.npu_swiglu:
            h = gate(torch.cat([g, u], dim=-1))
        else:
            h = layout.activation(module)(g) * u
    else:
        h = gate(_project(batch, x, up, bias(layout.up_bias), layout.transposed, kind, rows,
                          f"{owner}.{layout.up}"))
    y = _project(
        batch, h, weights[layout.down], bias(layout.down_bias), layout.transposed_of(layout.down),
        kind, rows, f"{owner}.{layout.down}",
    )
    if layout.post_norm:
        y = module.post_expert_norm(y)
    return y


def local_weights(module: nn.Module, layout: ExpertsLayout, fp8: bool = False, names=None) -> dict:
    """The local experts' weights (``names``, default all) as their GEMMs read them (``_weight_of``)."""
    return {n: _weight_of(module, layout, n, fp8) for n in (layout.roles if names is None else names)}


def _weight_of(module: nn.Module, layout: ExpertsLayout, name: str, fp8: bool = False):
    """Weight ``name`` as ``[E, ., .]``; for experts held as modules their GEMM weights unstacked
    (:class:`~.stacked.StackedParams`), their biases (small) stacked. ``fp8``: runtime.fp8_gemm."""
    fp8 = fp8 and name in (layout.gate, layout.up, layout.down)
    if fp8 and (layout.modules or layout.flat or layout.split):
        raise ExpertParallelError(f"runtime.fp8_gemm: {type(module).__name__} holds its experts as modules or flat "
                                  "weights, which are never kept as FP8 codes; set runtime.fp8_gemm: false")
    if layout.modules and name in (layout.gate, layout.up, layout.down):
        return StackedParams([layout.param(module, f"{k}.{name}") for k in layout.held])
    options = getattr(installed.binding(module), "options", None)
    if not (layout.flat or layout.split):
        kept = quantized.projection_of(module, name, type(module).__name__,
                                       options.dequant_chunk_bytes if options else quantized.CHUNK_BYTES, fp8)
        if kept is not None and kept.weight.stored.in_first != layout.transposed_of(name):
            raise ExpertParallelError(f"{type(module).__name__}.{name}: its kept codes stand for the other "
                                      "orientation than the holder's layout")
        if kept is not None:
            return kept
    return layout.weight(module, name)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a matmul of ``x`` in, or None outside autocast (or for rows it
    would not cast)."""
    device = x.device.type
    if not x.is_floating_point() or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def _default_gate(act, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def keep_local_experts(module: nn.Module, num_experts: int, keep) -> None:
    """Keep only the experts ``keep`` (global ids, in local row order) in the holder's per-expert parameters.

    Used when a full module was built (tests, EP=1 -> EP=n); the loader reads only local experts instead.
    """
    keep = list(keep)
    layout = ExpertsLayout.of(module)
    if layout.modules:
        expert_modules.keep_experts(module, [layout.expert_keys[e] for e in keep])
        return
    for name in layout.weight_names:
        p = layout.param(module, name)
        w = layout.per_expert(p.detach())  # flat [E*R, C]: the rows [e*R, (e+1)*R) of each kept expert e
        held = list(layout.rows_of(name, keep, num_experts))  # + the zero experts' rows, on every rank
        if w.shape[0] != num_experts + len(held) - len(keep):
            raise ExpertParallelError(
                f"{type(module).__name__}.{name} has {w.shape[0]} experts in dim 0, expected num_experts={num_experts}"
            )
        rows = w[held[0] : held[-1] + 1] if held == list(range(held[0], held[-1] + 1)) else w[held]
        layout.set_param(module, name, nn.Parameter(layout.stored(rows).clone(), requires_grad=p.requires_grad))
    owners = {module} | ({layout.owner_of(module, n)[0] for n in layout.weight_names} if layout.split else set())
    for owner in owners:  # split layouts: the children holding the weights count their experts too
        if hasattr(owner, "num_experts"):
            owner.num_experts = len(keep)
