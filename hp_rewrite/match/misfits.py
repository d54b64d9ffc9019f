"""MoE-like modules that do not follow the experts contract: what describe-moe reports as *non_contract*.

hp-rewrite leaves these untouched; each :class:`Misfit` says why and what the user can do:

* 3-D per-expert weights in a module that is not an experts holder (every failed check is named),
  or split over sub-modules holding one 3-D tensor each;
* flat 2-D ``[E*I, H]`` expert weights outside the flat layout the runtime shards (one gate/up/down
  triple of one shape, the only parameters of a direct child of a holder: DBRX's ``mlp.w1/v1/w2``);
* experts stored as separate sub-modules next to a router with one logit per expert (or with no
  router at all: experts chosen by another input);
* embedding "experts" (rows selected by product keys);
* routers giving one logit per expert with no experts anywhere near them;
* experts holders whose block structure could not be analysed (``not-a-holder``).

Everything is found by structure on the model built on the meta device, never by model name.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass, fields, replace

from torch import nn

from ..runtime.compute.experts import ExpertsLayout
from ..runtime.errors import ExpertParallelError
from .snippets import ACTIONS, UNTOUCHED, path_glob
from .structure import experts_layout

_EXPERT_COUNT = re.compile(r"^(?:moe_)?(?:num|n)_(?:local_|routed_)?experts$")

#: ``(parameter name, shape)`` pairs, in the module's order
Shapes = tuple[tuple[str, tuple[int, ...]], ...]
#: ``(child name, child class name)`` pairs, in the module's order
Children = tuple[tuple[str, str], ...]


class _Absent:
    """A fact the check did not look for: left out of the JSON document (``None`` is 'looked, none')."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


@dataclass(frozen=True)
class MisfitFacts:
    """What a check measured on the module (its ``structure`` in the JSON document)."""

    num_experts: int | _Absent = ABSENT
    router: str | None | _Absent = ABSENT  # a glob of the Linear giving one logit per expert
    failed_checks: tuple[str, ...] | _Absent = ABSENT  # experts-contract checks failed, most telling first
    expert_class: str | _Absent = ABSENT  # experts as separate modules: their class

    def as_dict(self) -> dict:
        return {
            f.name: list(v) if isinstance(v, tuple) else v
            for f in fields(self)
            if (v := getattr(self, f.name)) is not ABSENT
        }

    @classmethod
    def from_dict(cls, d: dict) -> MisfitFacts:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k != "paths_glob"})


@dataclass(frozen=True)
class Misfit:
    """A module (or identical modules at ``paths``) that looks like MoE but is no experts holder."""

    paths: tuple[str, ...]
    module_class: str
    kind: str  # which contract it breaks: a key of ACTIONS
    children: Children
    params: Shapes
    facts: MisfitFacts
    reason: str  # ends with "; left untouched by hp-rewrite"
    action: str  # what the user can do

    @property
    def paths_glob(self) -> list[str]:
        return sorted({path_glob(p) for p in self.paths})

    def group_key(self) -> tuple:
        return (self.module_class, self.kind, self.children, self.params, self.reason, self.facts)

    def as_dict(self) -> dict:
        return {
            "paths": list(self.paths),
            "class": self.module_class,
            "kind": self.kind,
            "children": children_json(self.children),
            "params": shapes_json(self.params),
            "structure": {**self.facts.as_dict(), "paths_glob": self.paths_glob},
            "status": UNTOUCHED,
            "reason": self.reason,
            "action": self.action,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Misfit:
        return cls(tuple(d["paths"]), d["class"], d["kind"], children_from_json(d["children"]),
                   shapes_from_json(d["params"]), MisfitFacts.from_dict(d["structure"]), d["reason"], d["action"])


def children_json(children: Children) -> list[dict]:
    return [{"name": n, "class": c} for n, c in children]


def children_from_json(items: list[dict]) -> Children:
    return tuple((c["name"], c["class"]) for c in items)


def shapes_json(params: Shapes) -> dict[str, list[int]]:
    return {k: list(v) for k, v in params}


def shapes_from_json(params: dict) -> Shapes:
    return tuple((k, tuple(v)) for k, v in params.items())


# -- small helpers on modules ----------------------------------------------------------------------


def _shape(p) -> tuple[int, ...]:
    return tuple(int(d) for d in p.shape)


def direct_params(module: nn.Module, prefix: str = "") -> Shapes:
    """The module's own parameters (not its children's), names prefixed by ``prefix``."""
    return tuple((f"{prefix}{n}", _shape(p)) for n, p in module.named_parameters(recurse=False))


def children_of(module: nn.Module) -> Children:
    return tuple((n, type(c).__name__) for n, c in module.named_children())


def _is_builtin(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn")


def _int_attr(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _expert_counts(module: nn.Module | None) -> dict[str, int]:
    """Integer attributes named like an expert count (num_experts, n_routed_experts, ...), >= 2."""
    if module is None:
        return {}
    found = {}
    for k, v in vars(module).items():
        if _EXPERT_COUNT.match(k) and (n := _int_attr(v)) is not None and n >= 2:
            found[k] = n
    return found


def _config_expert_counts(config, depth: int = 0) -> set[int]:
    counts: set[int] = set()
    if config is None or depth > 4:
        return counts
    for k, v in vars(config).items():
        if _EXPERT_COUNT.match(k.lstrip("_")) and (n := _int_attr(v)) is not None and n >= 2:
            counts.add(n)
        elif hasattr(v, "to_dict") and hasattr(v, "model_type"):
            counts |= _config_expert_counts(v, depth + 1)
    for alias in getattr(type(config), "attribute_map", {}) or {}:
        if _EXPERT_COUNT.match(alias):
            with contextlib.suppress(Exception):
                if (n := _int_attr(getattr(config, alias))) is not None and n >= 2:
                    counts.add(n)
    return counts


def _forward_param_names(module: nn.Module) -> tuple[list[str], bool]:
    fn = type(module).forward
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    params = list(inspect.signature(fn).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional, any(p.kind == p.VAR_POSITIONAL for p in params)


def parent_of(model: nn.Module, path: str) -> tuple[str, nn.Module | None]:
    """``(parent path, parent module)``; ``("", None)`` for the root."""
    if not path:
        return "", None
    parent_path = path.rpartition(".")[0]
    return parent_path, model.get_submodule(parent_path) if parent_path else model


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _logit_layers(scope: nn.Module, scope_path: str, skip: str, depth: int = 2) -> list[tuple[str, int, int]]:
    """(path, out_features, in_features) of every Linear-like module (a 2-D ``weight``) in ``scope``
    down to ``depth`` levels, not under ``skip``."""
    found = []

    def walk(m: nn.Module, path: str, d: int) -> None:
        for name, child in m.named_children():
            p = _join(path, name)
            if p == skip or p.startswith(skip + "."):
                continue
            w = getattr(child, "weight", None)
            if isinstance(w, nn.Parameter) and w.dim() == 2 and not isinstance(child, nn.Embedding):
                found.append((p, int(w.shape[0]), int(w.shape[1])))
            if d > 1:
                walk(child, p, d - 1)

    walk(scope, scope_path, depth)
    return found


def _find_router(model: nn.Module, path: str, num_experts: int, hidden: int | None = None) -> str | None:
    """A Linear producing ``num_experts`` logits next to ``path``: in its parent or grandparent."""
    parent_path, parent = parent_of(model, path)
    for scope_path, scope in (
        (parent_path, parent),
        parent_of(model, parent_path) if parent_path else ("", None),
    ):
        if scope is None:
            continue
        for p, out, inp in _logit_layers(scope, scope_path, path):
            if out == num_experts and (hidden is None or inp == hidden):
                return path_glob(p)
    return None


# -- the experts-contract checks -------------------------------------------------------------------


def _three_d(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {
        n: _shape(p)
        for n, p in module.named_parameters(recurse=False)
        if p.dim() == 3 and p.is_floating_point()
    }


def _contract_failures(module: nn.Module, model: nn.Module, path: str) -> list[tuple[str, str]]:
    """(kind, explanation) for every experts-contract check ``module`` fails, most telling first."""
    fails: list[tuple[str, str]] = []
    three = _three_d(module)
    dims = {n: s[0] for n, s in three.items()}
    declared = _int_attr(getattr(module, "num_experts", None))
    if len(set(dims.values())) > 1:
        listing = ", ".join(f"{n} {d}" for n, d in dims.items())
        fails.append(
            (
                "unequal-expert-dims",
                f"its per-expert weights disagree on the number of experts (dim 0: {listing}), and not as "
                "zero (identity) experts do, which hp-rewrite runs expert-parallel: only the gate/up weight "
                "holding extra rows after the down weight's experts, in a holder whose forward "
                "takes (hidden, top_k_index, top_k_weights) and whose num_experts, if any, counts the routed "
                "experts or all of them",
            )
        )
    if declared is None:
        fails.append(("no-num-experts", "it has no integer `num_experts` attribute"))
    layout = None
    try:
        layout = ExpertsLayout.of(module)
    except ExpertParallelError:
        names = ", ".join(sorted(dims)) or "none"
        fails.append(
            (
                "unknown-weight-names",
                f"its weight names ({names}) are none the runtime knows: 3-D gate_up_proj (or up_proj) + "
                "down_proj, gate_proj/up_proj/down_proj, or w1/w3/w2",
            )
        )
    if layout is not None and declared is not None:
        wrong = [n for n in layout.weight_names if layout.weight(module, n).shape[0] != declared]
        if wrong:
            fails.append(
                (
                    "unequal-expert-dims",
                    f"num_experts is {declared} but dim 0 of {', '.join(wrong)} is not",
                )
            )
    positional, varargs = _forward_param_names(module)
    if len(positional) < 3 and not varargs:
        sig = ", ".join(positional)
        n = declared or (next(iter(dims.values())) if dims else 0)
        router = _find_router(model, path, n) if n else None
        where = f" (the router `{router}` gives {n} logits outside it)" if router else ""
        fails.append(
            (
                "no-routing-inputs",
                f"forward({sig}) does not take (hidden, top_k_index, top_k_weights){where}: the routing "
                "weights never reach the experts, so they are applied outside - to the experts' input "
                "(dense experts run on every token, scaled by the router score) or to their stacked "
                "outputs; sparse dispatch with output-side weights would change the results",
            )
        )
    if not fails:
        fails.append(("not-a-holder", "it fails the experts-holder checks (num_experts, layout, forward)"))
    return fails


def _finding(kind: str, path: str, module: nn.Module, reason: str, params: Shapes, facts: MisfitFacts) -> Misfit:
    return Misfit((path,), type(module).__name__, kind, children_of(module), params, facts,
                  f"{reason}; {UNTOUCHED}", ACTIONS[kind])


def broken_holder(path: str, holder: nn.Module, reason: str) -> Misfit:
    """An experts holder whose block structure analysis raised (``reason``)."""
    return _finding("not-a-holder", path, holder, reason, direct_params(holder), MisfitFacts())


def _check_3d(model: nn.Module, path: str, m: nn.Module) -> Misfit | None:
    three = _three_d(m)
    if len(three) >= 2 and all(s[0] >= 2 for s in three.values()):
        fails = _contract_failures(m, model, path)
        reason = (
            f"{type(m).__name__} holds 3-D per-expert weights but is not an experts holder: "
            + "; ".join(why for _, why in fails)
        )
        n = _int_attr(getattr(m, "num_experts", None)) or min(s[0] for s in three.values())
        facts = MisfitFacts(n, _find_router(model, path, n), tuple(k for k, _ in fails))
        return _finding(fails[0][0], path, m, reason, direct_params(m), facts)
    # the weights split over child modules holding one 3-D tensor each
    split: dict[str, tuple[int, ...]] = {}
    for name, child in m.named_children():
        if _is_builtin(child) or experts_layout(child) is not None:
            continue
        sub = _three_d(child)
        if len(sub) >= 2:
            return None  # the child is the candidate, checked on its own
        split.update({f"{name}.{n}": s for n, s in sub.items()})
    if len(split) >= 2 and len({s[0] for s in split.values()}) == 1 and next(iter(split.values()))[0] >= 2:
        n = next(iter(split.values()))[0]
        owners = sorted({k.split(".")[0] for k in split})
        own, varargs = _forward_param_names(m)
        if not any(callable(getattr(m, a, None)) for a in ("act_fn", "activation_fn", "activation")):
            # hp-rewrite drives a block holding its MLP experts so (JetMoE's MoE); not one without an activation
            reason = (
                f"its per-expert weights ({', '.join(split)}, {n} experts) are two projections with no activation "
                "between them, split over sub-modules: experts that are not an MLP (JetMoE's mixture of attention "
                "maps queries in and reduces outputs around the attention, through map() and reduce() rather "
                "than forward), which an expert-parallel MLP dispatch cannot run"
            )
        else:
            reason = (
                f"its per-expert weights ({', '.join(split)}, {n} experts) are split over sub-modules "
                f"({', '.join(owners)}) instead of one experts holder, in shapes the runtime does not know"
            )
        if len(own) < 3 and not varargs:
            reason += f"; forward({', '.join(own)}) does not take (hidden, top_k_index, top_k_weights)"
        facts = MisfitFacts(n, _find_router(model, f"{path}.{owners[0]}", n))
        params = direct_params(m) + tuple(split.items())
        return _finding("split-expert-weights", path, m, reason, params, facts)
    return None


def _check_flat(model: nn.Module, path: str, m: nn.Module) -> Misfit | None:
    flat = {n: _shape(p) for n, p in m.named_parameters(recurse=False) if p.dim() == 2}
    if len(flat) < 2 or len({tuple(s) for s in flat.values()}) != 1:
        return None
    rows = next(iter(flat.values()))[0]
    parent_path, parent = parent_of(model, path)
    counts = {**_expert_counts(parent), **_expert_counts(m)}
    n = next((c for c in counts.values() if rows % c == 0 and rows > c), None)
    if n is None:
        return None
    listing = ", ".join(f"{k} {list(v)}" for k, v in flat.items())
    reason = (
        f"flat 2-D expert weights ({listing}: {n} experts x {rows // n} rows stacked along dim 0) "
        "instead of 3-D [E, out, in] tensors"
    )
    own, _ = _forward_param_names(m)
    up, up_varargs = _forward_param_names(parent) if parent is not None else ([], False)
    if parent is not None and (len(up) >= 3 or up_varargs):
        reason += (
            f"; the enclosing {type(parent).__name__}.forward({', '.join(up)}) has the experts call signature, "
            f"but the runtime shards flat weights only as one gate/up/down triple of one shape (w1/v1/w2, "
            f"w1/w3/w2 or gate_proj/up_proj/down_proj, no biases) that are the only parameters of a direct "
            f"child of the holder (these are in {path.rpartition('.')[2]}, read through "
            f"{type(m).__name__}.forward({', '.join(own)}))"
        )
    else:
        reason += f"; {type(m).__name__}.forward({', '.join(own)}) does not take (hidden, top_k_index, top_k_weights)"
    facts = MisfitFacts(n, _find_router(model, parent_path or path, n))
    return _finding("flat-2d-experts", path, m, reason, direct_params(m), facts)


def _ffn_like(m: nn.Module, hidden: int) -> bool:
    if any(isinstance(c, (nn.ModuleList, nn.ModuleDict)) for c in m.modules()):
        return False
    w2 = [p for p in m.parameters() if p.dim() == 2]
    return (
        2 <= len(w2) <= 4 and any(w.shape[1] == hidden for w in w2) and any(w.shape[0] == hidden for w in w2)
    )


def _check_expert_modules(model: nn.Module, path: str, m: nn.Module) -> Misfit | None:
    kids = [(n, c) for n, c in m.named_children() if any(True for _ in c.parameters())]
    if len(kids) < 2:
        return None
    groups: dict[tuple, list[str]] = {}
    for n, c in kids:
        sig = (type(c), tuple((k, tuple(p.shape)) for k, p in c.named_parameters()))
        groups.setdefault(sig, []).append(n)
    sig, names = max(groups.items(), key=lambda kv: len(kv[1]))
    count = len(names)
    if (
        count < 2
        or _is_builtin(m.get_submodule(names[0]))
        and not isinstance(m, (nn.ModuleList, nn.ModuleDict))
    ):
        return None
    first = m.get_submodule(names[0])
    router = None
    parent_path, _ = parent_of(model, path)
    for scope_path, scope in (
        parent_of(model, path),
        parent_of(model, parent_path) if parent_path else ("", None),
    ):
        if scope is None:
            continue
        for p, out, inp in _logit_layers(scope, scope_path, path):
            if out == count and _ffn_like(first, inp):
                router = p
                break
        if router:
            break
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if router is not None and head is not None and model.get_submodule(router) is head:
        router = None
    if router is None:
        return _unrouted_expert_modules(path, m, names, first)
    router = path_glob(router)
    kind_of = (
        "ModuleList"
        if isinstance(m, nn.ModuleList)
        else "ModuleDict"
        if isinstance(m, nn.ModuleDict)
        else type(m).__name__
    )
    reason = (
        f"its {count} experts are separate modules ({names[0]} ... {names[-1]}: {type(first).__name__} in a "
        f"{kind_of}) beside the router `{router}` with {count} logits: experts as modules with "
        "capacity / one-hot dispatch, not an experts holder with 3-D weights and "
        "forward(hidden, top_k_index, top_k_weights)"
    )
    weights = [k for k, _ in first.named_parameters()]
    reason += (
        f": each expert keeps its own parameters ({names[0]}.{weights[0]} ...), so sharding them means stacking "
        f"them into [{count}, ...] tensors under new parameter and checkpoint names"
    )
    drops = sorted({d.p for d in first.modules() if isinstance(d, nn.Dropout) and d.p > 0})
    if drops:
        reason += (
            f"; inside each expert a dropout (p={drops[0]:g}) draws its mask per expert call in training, in an "
            "order and on a generator an expert-parallel run cannot reproduce"
        )
    params = tuple((f"{names[0]}.{k}", _shape(p)) for k, p in first.named_parameters())
    facts = MisfitFacts(count, router, expert_class=type(first).__name__)
    return _finding("expert-modules", path, m, reason, params, facts)


def _unrouted_expert_modules(path: str, m: nn.Module, names: list[str], first: nn.Module) -> Misfit | None:
    """A ModuleList / ModuleDict named like experts, with no router giving one logit per expert."""
    if not isinstance(m, (nn.ModuleList, nn.ModuleDict)) or "expert" not in path.rpartition(".")[2].lower():
        return None
    count = len(names)
    reason = (
        f"its {count} experts are separate modules ({names[0]} ... {names[-1]}: {type(first).__name__}) and no "
        f"Linear next to them gives {count} logits: the expert is not chosen per token by a router (it is "
        "selected by another input, e.g. a dataset or task index)"
    )
    params = tuple((f"{names[0]}.{k}", _shape(p)) for k, p in first.named_parameters())
    facts = MisfitFacts(count, None, expert_class=type(first).__name__)
    return _finding("unrouted-expert-modules", path, m, reason, params, facts)


def _check_embedding(model: nn.Module, path: str, m: nn.Module) -> Misfit | None:
    counts = set(_expert_counts(m).values())
    embeds = [n for n, c in m.named_children() if isinstance(c, nn.Embedding) and c.num_embeddings in counts]
    if not embeds:
        return None
    n = m.get_submodule(embeds[0]).num_embeddings
    reason = (
        f"its {n} 'experts' are embedding rows ({', '.join(embeds)}: nn.Embedding({n}, ...)) selected by "
        "product keys, not FFN experts taking (hidden, top_k_index, top_k_weights)"
    )
    params = tuple((f"{e}.weight", _shape(m.get_submodule(e).weight)) for e in embeds)
    return _finding("embedding-experts", path, m, reason, params, MisfitFacts(n))


def _router_children(m: nn.Module, n: int) -> str | None:
    for name, child in m.named_children():
        if "router" not in name and ("gate" not in name or name.endswith("proj")):
            continue
        w = getattr(child, "weight", None)
        if isinstance(w, nn.Parameter) and w.dim() == 2 and w.shape[0] == n:
            return name
        for sub, mod in child.named_modules():
            w = getattr(mod, "weight", None)
            if sub and isinstance(w, nn.Parameter) and w.dim() == 2 and w.shape[0] == n:
                return f"{name}.{sub}"
    return None


def find_misfits(model: nn.Module, config, holders: list[str]) -> list[Misfit]:
    """Every MoE-like module outside the experts holders ``holders`` (and their blocks), in model order;
    then the routers with one logit per expert (counts from the module or ``config``) and no experts."""
    blocks = {p.rpartition(".")[0] for p in holders}
    findings: list[Misfit] = []
    taken: list[str] = []  # subtrees already explained (holders, findings)

    def inside(path: str, roots: list[str]) -> bool:
        return any(path == r or path.startswith(r + ".") for r in roots)

    for path, m in model.named_modules():
        if (
            not path
            or inside(path, holders + taken)
            or path.rpartition(".")[0] in blocks
            or _is_builtin(m)
            and not isinstance(m, (nn.ModuleList, nn.ModuleDict))
        ):
            continue
        if experts_layout(m) is not None:
            continue
        for check in (_check_3d, _check_flat, _check_embedding, _check_expert_modules):
            f = check(model, path, m)
            if f is not None:
                findings.append(f)
                taken.append(path)
                break
    # routers giving E logits with no experts anywhere near them
    covered = holders + taken + [p.rpartition(".")[0] for p in holders + taken]
    config_counts = _config_expert_counts(config)
    for path, m in model.named_modules():
        if not path or _is_builtin(m) or inside(path, covered):
            continue
        if any(c == path or c.startswith(path + ".") for c in covered):
            continue  # an ancestor of something already explained
        counts = set(_expert_counts(m).values()) or config_counts
        for n in sorted(counts):
            router = _router_children(m, n)
            if router is not None:
                reason = (
                    f"its child `{router}` gives {n} logits (one per expert) but there is no experts holder "
                    "and no expert weights next to it"
                )
                findings.append(
                    _finding(
                        "router-without-experts",
                        path,
                        m,
                        reason,
                        direct_params(m),
                        MisfitFacts(n, router),
                    )
                )
                covered.append(path)
                break
    return findings


def group_misfits(found: list[Misfit]) -> list[Misfit]:
    """Identical misfits (same class, kind, children, shapes, reason and facts) as one, paths joined."""
    groups: dict[tuple, list[Misfit]] = {}
    for f in found:
        groups.setdefault(f.group_key(), []).append(f)
    return [replace(same[0], paths=tuple(p for f in same for p in f.paths)) for same in groups.values()]
