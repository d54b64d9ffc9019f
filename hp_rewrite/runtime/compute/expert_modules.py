"""Experts held as modules: an ``nn.ModuleList`` / ``nn.ModuleDict`` of identical per-expert MLPs.

Switch Transformers and NLLB-MoE keep their experts this way, and so does most remote code on the Hub
(Mixtral's and Qwen1.5-MoE's original code and the models that exist only as remote code). Each
expert is a gated MLP (``down(act(gate(x)) * up(x))``, any names: gate_proj/up_proj/down_proj,
w1/w3/w2...) or a plain two-layer MLP (``down(act(up(x)))``, fc1/fc2, wi/wo...), its projections
``nn.Linear`` children with or without biases.

Which child plays which role, and the activation, are read by calling the first expert with one-wide
weights (:func:`roles_of`): the expert's own code decides, whatever its names. The activation is
the expert's ``act_fn``-like attribute when it has one (exact by construction), else the built-in
function that reproduces the call. The rewritten block keeps the expert modules of this rank under
their original keys (``experts.{e}.w1.weight``) and stacks their weights for the grouped GEMMs.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ExpertParallelError

ACT_ATTRS = ("act_fn", "activation_fn", "act", "activation", "activation_function")
_DOWN_NAMES = ("down_proj", "w2", "fc2", "wo", "c_proj", "dense_4h_to_h", "output_linear")


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: activations an expert may apply inline (no attribute to read), tried in this order
BUILTIN_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": _gelu_tanh, "relu": F.relu,
                       "relu2": _relu2, "quick_gelu": _quick_gelu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class ModuleRoles:
    """The roles of one expert module's ``Linear`` children (their names) and its activation:
    ``("attr", name)`` for an attribute of the expert, ``("fn", name)`` for :data:`BUILTIN_ACTIVATIONS`."""

    keys: tuple[str, ...]  # the container's keys of the experts, in expert-id order
    up: str
    down: str
    gate: str | None
    activation: tuple[str, str]
    up_bias: bool
    down_bias: bool
    gate_bias: bool


def expert_keys(module: nn.Module) -> tuple[str, ...]:
    """The keys of the container's children that have weights: its experts (a parameter-free child such
    as NLLB-MoE's ``token_dropout`` is the container's own)."""
    return tuple(k for k, m in module._modules.items() if m is not None and any(True for _ in m.parameters()))


def has_own_forward(module: nn.Module) -> bool:
    """Whether the container's class defines a forward (Switch's and NLLB-MoE's take the routing); a
    plain ModuleList / ModuleDict has none: its block calls each expert itself."""
    return type(module).forward is not nn.Module.forward and type(module) not in (ExpertModuleList, ExpertModuleDict)


def dropouts(module: nn.Module, keys) -> list[nn.Module]:
    """The dropout modules the experts ``keys`` and the container's own children apply in training."""
    own = [m for k, m in module._modules.items() if k not in set(expert_keys(module)) and m is not None]
    inside = [m for k in keys for m in module._modules[k].modules()] + [m for o in own for m in o.modules()]
    return [m for m in inside if isinstance(m, nn.modules.dropout._DropoutNd)]


def _linears(expert: nn.Module) -> dict[str, nn.Linear] | None:
    """The expert's ``Linear`` children, or None when it holds any other weight."""
    if any(True for _ in expert.parameters(recurse=False)):
        return None
    linears = {}
    for name, child in expert.named_children():
        if isinstance(child, nn.Linear) and type(child).forward is nn.Linear.forward:
            linears[name] = child
        elif any(True for _ in child.parameters()):
            return None  # a norm, an adapter, a nested block: not a plain MLP
    return linears if len(linears) in (2, 3) else None


def _shape_roles(linears: dict[str, nn.Linear]) -> list[tuple[str | None, str, str]] | None:
    """(gate, up, down) assignments the shapes allow (gate None for a plain MLP), most likely first."""
    names = list(linears)
    down_first = sorted(names, key=lambda n: (n not in _DOWN_NAMES, -names.index(n)))
    found = []
    for down in down_first:
        d = linears[down]
        ins = [n for n in names if n != down]
        if any((linears[n].in_features, linears[n].out_features) != (d.out_features, d.in_features) for n in ins):
            continue
        if len(ins) == 1:
            found.append((None, ins[0], down))
        else:
            found.extend((g, u, down) for g, u in itertools.permutations(ins))
    return found or None


def _call_one_wide(expert: nn.Module, linears: dict[str, nn.Linear], values: dict[str, float], x: torch.Tensor):
    """The expert's own forward with every projection one wide (``W = [[value]]``, zero biases)."""
    params = {}
    for name, lin in linears.items():
        params[f"{name}.weight"] = torch.tensor([[values[name]]])
        if lin.bias is not None:
            params[f"{name}.bias"] = torch.zeros(1)
    training = expert.training
    expert.eval()
    try:
        with torch.no_grad():
            return torch.func.functional_call(expert, params, (x,), strict=False)
    finally:
        expert.train(training)


def _activations(expert: nn.Module) -> list[tuple[tuple[str, str], object]]:
    own = [(("attr", a), getattr(expert, a)) for a in ACT_ATTRS if callable(getattr(expert, a, None))]
    return own + [(("fn", n), f) for n, f in BUILTIN_ACTIVATIONS.items()]


def roles_of(module: nn.Module) -> ModuleRoles | None:
    """The roles of ``module``'s experts when it is a ``ModuleList`` / ``ModuleDict`` of at least two
    experts of one class with the same projection shapes, each a gated or plain MLP that its own
    forward confirms (one-wide weights, 13 probe values); else None."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return None
    keys = expert_keys(module)
    experts = [module._modules[k] for k in keys]
    if len(experts) < 2 or len({type(e) for e in experts}) != 1:
        return None
    linears = _linears(experts[0])
    if linears is None:
        return None
    shapes = {n: (lin.in_features, lin.out_features, lin.bias is not None) for n, lin in linears.items()}
    for e in experts[1:]:
        other = _linears(e)
        if other is None or {n: (lin.in_features, lin.out_features, lin.bias is not None)
                             for n, lin in other.items()} != shapes:
            return None
    candidates = _shape_roles(linears)
    if candidates is None:
        return None
    t = torch.linspace(-3.0, 3.0, 13).unsqueeze(1)
    for gate, up, down in candidates:
        values = {down: -1.5, up: 0.5, **({gate: 1.0} if gate else {})}
        try:
            out = _call_one_wide(experts[0], linears, values, t)
        except Exception:  # noqa: BLE001 - the expert does not run as an MLP on these shapes
            return None
        if not isinstance(out, torch.Tensor) or out.shape != t.shape:
            return None
        for activation, fn in _activations(experts[0]):
            try:
                with torch.no_grad():  # down(act(gate x) * up x), or down(act(up x))
                    want = -1.5 * fn(t) * (0.5 * t) if gate else -1.5 * fn(0.5 * t)
            except Exception:  # noqa: BLE001 - an attribute that is not an activation
                continue
            if isinstance(want, torch.Tensor) and want.shape == t.shape and torch.allclose(out, want, atol=1e-6):
                return ModuleRoles(keys, up, down, gate, activation, shapes[up][2], shapes[down][2],
                                   bool(gate and shapes[gate][2]))
    return None


def activation_of(expert: nn.Module, activation: tuple[str, str]):
    kind, name = activation
    return getattr(expert, name) if kind == "attr" else BUILTIN_ACTIVATIONS[name]


def refuse_training_dropout(module: nn.Module, keys) -> None:
    """A dropout inside the experts (or the container's own, on their outputs) that is active: the
    grouped GEMMs never run the expert modules, and no expert-parallel run can draw the masks the
    unmodified model would draw (their order and generator differ), so training would silently differ."""
    active = [d for d in dropouts(module, keys) if d.training and d.p > 0]
    if active:
        raise ExpertParallelError(
            f"{type(module).__name__}: dropout (p={active[0].p}) inside the experts is active in training; the "
            "expert-parallel experts run as grouped GEMMs and cannot draw the masks the unmodified model draws. "
            "Train with that dropout at 0 (its config field, e.g. dropout_rate / activation_dropout / "
            "moe_token_dropout, before loading), or run this model data-parallel")


def keep_experts(module: nn.Module, keys) -> None:
    """Keep only the expert modules ``keys`` (in this order, under their original keys) in ``module``,
    and its parameter-free children."""
    experts = set(expert_keys(module))
    kept = OrderedDict((k, module._modules[k]) for k in keys)
    kept.update((k, m) for k, m in module._modules.items() if k not in experts)
    module._modules.clear()
    module._modules.update(kept)


class ExpertModuleList(nn.ModuleList):
    """An ``nn.ModuleList`` of expert modules made expert-parallel: the same container (names, indexing
    by key), with a ``forward`` of its class, which FSDP2 needs to wrap a container. The forward
    itself is the one ``install_expert_parallel`` binds on the instance."""

    def forward(self, *args, **kwargs):  # replaced per instance at install
        raise NotImplementedError(f"{type(self).__name__}: not installed")


class ExpertModuleDict(nn.ModuleDict):
    """:class:`ExpertModuleList` for an ``nn.ModuleDict`` of expert modules."""

    def forward(self, *args, **kwargs):  # replaced per instance at install
        raise NotImplementedError(f"{type(self).__name__}: not installed")


def with_forward_class(module: nn.Module) -> None:
    """Give a plain ``nn.ModuleList`` / ``nn.ModuleDict`` of experts a class with a forward (in place)."""
    cls = {nn.ModuleList: ExpertModuleList, nn.ModuleDict: ExpertModuleDict}.get(type(module))
    if cls is not None:
        module.__class__ = cls
