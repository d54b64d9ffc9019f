"""``hp-rewrite describe-moe``: what hp-rewrite sees in a checkpoint, and what it would do with it.

Everything is found by structure on the model built on the meta device, never by model name:

* **experts holders** (:func:`~hp_rewrite.match.structure.experts_layout`): their blocks are
  analysed and matched exactly as ``apply`` does (:func:`hp_rewrite.rewrite.analyze` with the
  default plan, confirmed by execution on a random-weight copy), giving an archetype or the reason
  none fits, plus a plan snippet to start from.
* **modules that look like MoE but do not follow the experts contract** (``non_contract``): 3-D
  per-expert weights in a module that is not a holder (the failed checks are named), flat 2-D
  ``[E*I, H]`` expert weights, experts stored as separate sub-modules next to a router with one
  logit per expert, embedding "experts", and routers with no experts at all. hp-rewrite leaves
  these untouched; each entry says why and what the user can do.

Identical blocks (same class, same structure, same shapes, same outcome) are grouped into one
entry listing every path, so a 48-layer model prints compactly.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from fnmatch import fnmatchcase
from pathlib import Path

from torch import nn

from ..loading.tiny import quiet_transformers
from ..runtime import ExpertParallelError, ExpertsLayout
from .archetype import MatchResult, choose_archetype, layout_name
from .structure import analyze_block, experts_layout, find_experts_holders

UNTOUCHED = "left untouched by hp-rewrite"
_EXPERT_COUNT = re.compile(r"^(?:moe_)?(?:num|n)_(?:local_|routed_)?experts$")
_DATA_PARALLEL = "run it data-parallel (every rank keeps all experts; hp-rewrite needs no plan entry for it)"
_EXTENSION = "or write an archetype extension for it (a Python module named under the plan's `extensions:`)"

# -- small helpers ---------------------------------------------------------------------------------


def _shape(p) -> list[int]:
    return [int(d) for d in p.shape]


def _direct_params(module: nn.Module, prefix: str = "") -> dict[str, list[int]]:
    return {f"{prefix}{n}": _shape(p) for n, p in module.named_parameters(recurse=False)}


def _children(module: nn.Module) -> list[dict]:
    return [{"name": n, "class": type(c).__name__} for n, c in module.named_children()]


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


def path_glob(path: str) -> str:
    """The module path with every numeric component replaced by ``*`` (``model.layers.*.mlp``)."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def compact_paths(paths: list[str]) -> str:
    """``model.layers.{0-3,5}.mlp`` for paths that differ in one numeric component, else a list."""
    if len(paths) == 1:
        return paths[0]
    split = [p.split(".") for p in paths]
    if len({len(s) for s in split}) == 1:
        diff = [i for i in range(len(split[0])) if len({s[i] for s in split}) > 1]
        if len(diff) == 1 and all(s[diff[0]].isdigit() for s in split):
            i = diff[0]
            nums = sorted({int(s[i]) for s in split})
            ranges, start = [], nums[0]
            for a, b in zip(nums, nums[1:] + [None], strict=True):
                if b != a + 1:
                    ranges.append(f"{start}" if start == a else f"{start}-{a}")
                    start = b
            head, tail = ".".join(split[0][:i]), ".".join(split[0][i + 1 :])
            middle = "{" + ",".join(ranges) + "}"
            return ".".join(x for x in (head, middle, tail) if x)
    return ", ".join(paths)


def ep_size_for(num_experts: int) -> int:
    """The largest of 8, 4, 2 that divides the expert count, else 1."""
    return next((n for n in (8, 4, 2) if num_experts % n == 0), 1)


def _same_level_match(path: str, glob: str) -> bool:
    """``glob`` matches ``path`` component by component (not a descendant of a matching module)."""
    parts, pattern = path.split("."), glob.split(".")
    return len(parts) == len(pattern) and all(fnmatchcase(a, b) for a, b in zip(parts, pattern, strict=True))


def plan_snippet(globs: list[str], num_experts: int, experts_level: bool, comment: str = "") -> str:
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    lines += ["version: 1", f"ep_size: {ep_size_for(num_experts)}", "modules:", "  include:"]
    lines += [f"    - {g}" for g in globs]
    if experts_level:
        lines += ["archetype:", "  router: auto", "  shared: auto", "  level: experts"]
    else:
        lines.append("archetype: auto")
    return "\n".join(lines) + "\n"


def _forward_param_names(module: nn.Module) -> tuple[list[str], bool]:
    fn = type(module).forward
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    params = list(inspect.signature(fn).parameters.values())[1:]
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional, any(p.kind == p.VAR_POSITIONAL for p in params)


def _parent(model: nn.Module, path: str) -> tuple[str, nn.Module | None]:
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
    parent_path, parent = _parent(model, path)
    for scope_path, scope in (
        (parent_path, parent),
        _parent(model, parent_path) if parent_path else ("", None),
    ):
        if scope is None:
            continue
        for p, out, inp in _logit_layers(scope, scope_path, path):
            if out == num_experts and (hidden is None or inp == hidden):
                return path_glob(p)
    return None


# -- experts holders (the contract) ----------------------------------------------------------------


def _match_all(model: nn.Module) -> list[MatchResult | tuple[str, nn.Module, str]]:
    """MatchResults for every experts holder, as ``apply`` computes them. If the analysis raises
    (a bug exposed by an unusual family), blocks are matched one by one and a failing one gets its
    exception as the reason: ``(experts_path, holder, reason)``."""
    from ..plan import DEFAULT_PLAN
    from ..rewrite import analyze, recorded_router_classes

    try:
        analysis = analyze(model, DEFAULT_PLAN)
        return analysis.matched + analysis.unmatched
    except Exception:  # noqa: BLE001 - fall back to block by block, below
        pass
    recorded = recorded_router_classes(model)
    forced = {"router": "auto", "shared": "auto", "level": "auto"}
    out: list = []
    cache: dict[tuple, MatchResult] = {}
    for path, holder in find_experts_holders(model):
        parent_path, parent = _parent(model, path)
        try:
            s = analyze_block(parent_path, parent if parent is not None else model, path.rpartition(".")[2])
        except Exception as e:  # noqa: BLE001
            out.append((path, holder, f"the structure analysis raised {type(e).__name__}: {e}"))
            continue
        key = (type(s.block), s.experts_name, type(s.experts))
        if key not in cache:
            router = getattr(s.block, s.router_name) if s.router_name else None
            try:
                cache[key] = choose_archetype(s, forced, recorded_router=type(router) in recorded)
            except Exception as e:  # noqa: BLE001
                cache[key] = MatchResult(s, None, f"the archetype probe raised {type(e).__name__}: {e}")
        first = cache[key]
        out.append(MatchResult(s, first.archetype, first.reason, first.tried))
    return out


#: Above this many bytes for one fp32 block copy, archetypes are confirmed on a shrunk config instead.
MATERIALIZE_LIMIT = 2 << 30


def _largest_block_bytes(model: nn.Module) -> int:
    sizes = [0]
    for path, _ in find_experts_holders(model):
        _, block = _parent(model, path)
        sizes.append(sum(p.numel() * 4 for p in (block or model).parameters()))
    return max(sizes)


def _match_via_small_copy(model: nn.Module, config, size: int) -> tuple[list, str]:
    """Blocks too large to materialise: the structure comes from ``model``, the archetype of each block
    class from the same classes in a shrunk copy of ``config`` (same code paths, tiny sizes)."""
    from ..loading.tiny import tiny_config
    from .structure import find_blocks

    gib = f"{size / 2**30:.1f} GiB"
    try:
        small = build_meta_model(tiny_config(config))[0]
        small_results = [r for r in _match_all(small) if isinstance(r, MatchResult)]
        known = {
            (type(r.structure.block), r.structure.experts_name, type(r.structure.experts)): r
            for r in small_results
        }
        why = ""
    except Exception as e:  # noqa: BLE001 - the shrunk copy is a convenience; say why it failed
        known, why = {}, _short(e)
    out = []
    for s in find_blocks(model):
        r = known.get((type(s.block), s.experts_name, type(s.experts)))
        if r is not None:
            out.append(MatchResult(s, r.archetype, r.reason, list(r.tried)))
        else:
            reason = (
                f"not confirmed: one block would need {gib} to materialise and the shrunk copy of the config "
                + (f"failed ({why})" if why else "has no block of this class")
                + "; run `hp-rewrite make-tiny --from-config` and describe that checkpoint"
            )
            out.append(MatchResult(s, None, reason))
    note = (
        f"one MoE block would need {gib} in fp32 to confirm its archetype by execution: archetypes were "
        "confirmed on the same block classes in a shrunk copy of this config"
    )
    return out, note


def _top_k(block: nn.Module, router: nn.Module | None) -> int | None:
    for owner in (router, block):
        k = _int_attr(getattr(owner, "top_k", None)) if owner is not None else None
        if k is not None:
            return k
    return None


def _holder_entry(r: MatchResult) -> tuple[tuple, dict]:
    s = r.structure
    router = getattr(s.block, s.router_name) if s.router_name else None
    params = {**_direct_params(s.block), **_direct_params(s.experts, f"{s.experts_name}.")}
    structure = {
        "router": s.router_name,
        "router_class": type(router).__name__ if router is not None else None,
        "experts": s.experts_name,
        "experts_class": type(s.experts).__name__,
        "layout": layout_name(s.experts),
        "num_experts": s.num_experts,
        "hidden_size": s.hidden_size,
        "top_k": _top_k(s.block, router),
        "shared": s.shared_name,
        "shared_gate": s.shared_gate_name,
        "others": list(s.others),
    }
    archetype = None
    if r.archetype is not None:
        archetype = {**r.archetype.as_dict(), "names": dict(r.archetype.names)}
    entry = {
        "paths": [s.path or s.experts_path],
        "class": type(s.block).__name__,
        "children": _children(s.block),
        "params": params,
        "structure": structure,
        "archetype": archetype,
        "reason": None if r.archetype is not None else (r.reason or "no archetype reproduces the block"),
        "tried": list(r.tried),
        "action": None if r.archetype is not None else _ACTIONS["unmatched"],
    }
    if r.archetype is not None and r.archetype.level == "experts" and not r.tried:
        entry["tried"].append(
            f"block level: no candidate for the router `{s.router_name}`: its forward(hidden) does not return "
            "(logits, top_k_weights, top_k_index)"
        )
    key = (
        type(s.block),
        type(s.experts),
        tuple((c["name"], c["class"]) for c in entry["children"]),
        tuple((k, tuple(v)) for k, v in params.items()),
        tuple(sorted((k, str(v)) for k, v in structure.items())),
        str(archetype),
        entry["reason"],
    )
    return key, entry


def _finish_group(entry: dict, untouched: list[str]) -> None:
    """Add the plan snippet; ``untouched`` are module paths the glob also matches that are no MoE block."""
    st = entry["structure"]
    globs = list(dict.fromkeys(path_glob(p) for p in entry["paths"]))
    n = st["num_experts"]
    if entry["archetype"] is not None:
        experts_level = entry["archetype"]["level"] == "experts"
        how = (
            "only the experts call is rewritten (the block keeps its own forward)"
            if experts_level
            else "the whole block forward is rewritten"
        )
        ep = ep_size_for(n)
        comment = f"{entry['class']}: {n} experts, {n // ep} per rank at ep_size {ep}; {how}"
    else:
        experts_level = False
        comment = (
            f"{entry['class']}: no archetype fits yet (see the reason); with this plan the block is\n"
            f"reported unmatched and {UNTOUCHED} until an extension handles it:\n"
            "extensions: [my_package.my_archetype]"
        )
    if untouched:
        comment += (
            f"\nthe glob also matches {len(untouched)} module(s) that are not MoE blocks ({compact_paths(untouched)}):"
            "\nthose (e.g. dense MLP layers) are never touched"
        )
    entry["plan_snippet"] = plan_snippet(globs, n, experts_level, comment)


# -- modules that look like MoE but do not follow the contract -------------------------------------


def _three_d(module: nn.Module) -> dict[str, list[int]]:
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
        low = min(dims.values())
        fails.append(
            (
                "unequal-expert-dims",
                f"its per-expert weights disagree on the number of experts (dim 0: {listing}): extra rows "
                f"such as identity 'zero' experts (ids >= {low} computed as identity, not as an FFN), which "
                "expert-parallel dispatch cannot shard",
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
        wrong = [n for n in layout.weight_names if getattr(module, n).shape[0] != declared]
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


_ACTIONS = {
    "unequal-expert-dims": (
        f"{_DATA_PARALLEL}, {_EXTENSION} that computes the extra (identity) experts locally as w*x "
        "and dispatches only ids below the routed-expert count"
    ),
    "no-num-experts": f"{_DATA_PARALLEL}, {_EXTENSION}",
    "unknown-weight-names": (
        f"{_DATA_PARALLEL}, {_EXTENSION} (or an adapter exposing the weights as 3-D gate_up_proj + "
        "down_proj with forward(hidden, top_k_index, top_k_weights))"
    ),
    "no-routing-inputs": (
        f"{_DATA_PARALLEL}, {_EXTENSION} that dispatches each token to its selected experts with the "
        "router score applied on the input side and output weight 1"
    ),
    "not-a-holder": f"{_DATA_PARALLEL}, {_EXTENSION}",
    "unmatched": (f"{_DATA_PARALLEL} - apply reports it unmatched and leaves it as it is - {_EXTENSION}"),
    "split-expert-weights": (
        f"{_DATA_PARALLEL}, {_EXTENSION} (an adapter must expose the weights as one experts holder "
        "taking (hidden, top_k_index, top_k_weights))"
    ),
    "flat-2d-experts": (
        f"{_DATA_PARALLEL}, {_EXTENSION} (an adapter can view each [E*I, H] weight as [E, I, H] and "
        "expose forward(hidden, top_k_index, top_k_weights))"
    ),
    "expert-modules": (
        f"{_DATA_PARALLEL}; experts as separate modules with capacity / one-hot dispatch are not "
        "supported - converting them to one fused 3-D experts holder (gate_up_proj/up_proj + "
        f"down_proj) would make the block eligible, {_EXTENSION}"
    ),
    "embedding-experts": (
        f"{_DATA_PARALLEL}: embedding rows selected by product keys are not token-routed FFN experts "
        "and there is nothing to dispatch"
    ),
    "unrouted-expert-modules": (
        f"{_DATA_PARALLEL}: without per-token routing there is nothing to dispatch across ranks"
    ),
    "router-without-experts": (
        f"{_DATA_PARALLEL}; if the experts exist under another structure, {_EXTENSION}"
    ),
}


def _finding(kind: str, path: str, module: nn.Module, reason: str, params: dict, structure: dict) -> dict:
    return {
        "paths": [path],
        "class": type(module).__name__,
        "kind": kind,
        "children": _children(module),
        "params": params,
        "structure": structure,
        "status": UNTOUCHED,
        "reason": f"{reason}; {UNTOUCHED}",
        "action": _ACTIONS[kind],
    }


def _check_3d(model: nn.Module, path: str, m: nn.Module) -> dict | None:
    three = _three_d(m)
    if len(three) >= 2 and all(s[0] >= 2 for s in three.values()):
        fails = _contract_failures(m, model, path)
        reason = (
            f"{type(m).__name__} holds 3-D per-expert weights but is not an experts holder: "
            + "; ".join(why for _, why in fails)
        )
        n = _int_attr(getattr(m, "num_experts", None)) or min(s[0] for s in three.values())
        structure = {
            "num_experts": n,
            "router": _find_router(model, path, n),
            "failed_checks": [k for k, _ in fails],
        }
        return _finding(fails[0][0], path, m, reason, _direct_params(m), structure)
    # the weights split over child modules holding one 3-D tensor each
    split: dict[str, list[int]] = {}
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
        reason = (
            f"its per-expert weights ({', '.join(split)}, {n} experts) are split over sub-modules "
            f"({', '.join(owners)}) instead of one experts holder, under weight names the runtime does not know"
        )
        if len(own) < 3 and not varargs:
            reason += f"; forward({', '.join(own)}) does not take (hidden, top_k_index, top_k_weights)"
        structure = {"num_experts": n, "router": _find_router(model, f"{path}.{owners[0]}", n)}
        params = {**_direct_params(m), **split}
        return _finding("split-expert-weights", path, m, reason, params, structure)
    return None


def _check_flat(model: nn.Module, path: str, m: nn.Module) -> dict | None:
    flat = {n: _shape(p) for n, p in m.named_parameters(recurse=False) if p.dim() == 2}
    if len(flat) < 2 or len({tuple(s) for s in flat.values()}) != 1:
        return None
    rows = next(iter(flat.values()))[0]
    parent_path, parent = _parent(model, path)
    counts = {**_expert_counts(parent), **_expert_counts(m)}
    n = next((c for c in counts.values() if rows % c == 0 and rows > c), None)
    if n is None:
        return None
    listing = ", ".join(f"{k} {v}" for k, v in flat.items())
    reason = (
        f"flat 2-D expert weights ({listing}: {n} experts x {rows // n} rows stacked along dim 0) "
        "instead of 3-D [E, out, in] tensors"
    )
    own, _ = _forward_param_names(m)
    up, up_varargs = _forward_param_names(parent) if parent is not None else ([], False)
    if parent is not None and (len(up) >= 3 or up_varargs):
        reason += (
            f"; the enclosing {type(parent).__name__}.forward({', '.join(up)}) has the experts call signature, "
            f"but the runtime finds no 3-D expert weights on it to shard (they are in {path.rpartition('.')[2]}, "
            f"read through {type(m).__name__}.forward({', '.join(own)}))"
        )
    else:
        reason += f"; {type(m).__name__}.forward({', '.join(own)}) does not take (hidden, top_k_index, top_k_weights)"
    structure = {"num_experts": n, "router": _find_router(model, parent_path or path, n)}
    return _finding("flat-2d-experts", path, m, reason, _direct_params(m), structure)


def _ffn_like(m: nn.Module, hidden: int) -> bool:
    if any(isinstance(c, (nn.ModuleList, nn.ModuleDict)) for c in m.modules()):
        return False
    w2 = [p for p in m.parameters() if p.dim() == 2]
    return (
        2 <= len(w2) <= 4 and any(w.shape[1] == hidden for w in w2) and any(w.shape[0] == hidden for w in w2)
    )


def _check_expert_modules(model: nn.Module, path: str, m: nn.Module) -> dict | None:
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
    parent_path, _ = _parent(model, path)
    for scope_path, scope in (
        _parent(model, path),
        _parent(model, parent_path) if parent_path else ("", None),
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
    params = {f"{names[0]}.{k}": _shape(p) for k, p in first.named_parameters()}
    structure = {"num_experts": count, "router": router, "expert_class": type(first).__name__}
    return _finding("expert-modules", path, m, reason, params, structure)


def _unrouted_expert_modules(path: str, m: nn.Module, names: list[str], first: nn.Module) -> dict | None:
    """A ModuleList / ModuleDict named like experts, with no router giving one logit per expert."""
    if not isinstance(m, (nn.ModuleList, nn.ModuleDict)) or "expert" not in path.rpartition(".")[2].lower():
        return None
    count = len(names)
    reason = (
        f"its {count} experts are separate modules ({names[0]} ... {names[-1]}: {type(first).__name__}) and no "
        f"Linear next to them gives {count} logits: the expert is not chosen per token by a router (it is "
        "selected by another input, e.g. a dataset or task index)"
    )
    params = {f"{names[0]}.{k}": _shape(p) for k, p in first.named_parameters()}
    structure = {"num_experts": count, "router": None, "expert_class": type(first).__name__}
    return _finding("unrouted-expert-modules", path, m, reason, params, structure)


def _check_embedding(model: nn.Module, path: str, m: nn.Module) -> dict | None:
    counts = set(_expert_counts(m).values())
    embeds = [n for n, c in m.named_children() if isinstance(c, nn.Embedding) and c.num_embeddings in counts]
    if not embeds:
        return None
    n = m.get_submodule(embeds[0]).num_embeddings
    reason = (
        f"its {n} 'experts' are embedding rows ({', '.join(embeds)}: nn.Embedding({n}, ...)) selected by "
        "product keys, not FFN experts taking (hidden, top_k_index, top_k_weights)"
    )
    params = {f"{e}.weight": _shape(m.get_submodule(e).weight) for e in embeds}
    return _finding("embedding-experts", path, m, reason, params, {"num_experts": n})


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


def _non_contract(model: nn.Module, config, holders: list[str]) -> list[dict]:
    blocks = {p.rpartition(".")[0] for p in holders}
    findings: list[dict] = []
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
                        _direct_params(m),
                        {"num_experts": n, "router": router},
                    )
                )
                covered.append(path)
                break
    return findings


def _group(entries: list[tuple[tuple, dict]]) -> list[dict]:
    groups: dict[tuple, dict] = {}
    for key, entry in entries:
        if key in groups:
            groups[key]["paths"].extend(entry["paths"])
        else:
            groups[key] = entry
    return list(groups.values())


def _finding_key(f: dict) -> tuple:
    return (
        f["class"],
        f["kind"],
        tuple((c["name"], c["class"]) for c in f["children"]),
        tuple((k, tuple(v)) for k, v in f["params"].items()),
        f["reason"],
        str(f["structure"]),
    )


# -- the command -----------------------------------------------------------------------------------


def describe(model: nn.Module, config) -> dict:
    """The describe-moe document for a model built from ``config`` (normally on the meta device)."""
    note = None
    with quiet_transformers():
        size = _largest_block_bytes(model)
        if size > MATERIALIZE_LIMIT:
            results, note = _match_via_small_copy(model, config, size)
        else:
            results = _match_all(model)
    holders = [name for name, _ in find_experts_holders(model)]
    order = {p: i for i, p in enumerate(holders)}
    entries, broken = [], []
    for r in results:
        if isinstance(r, tuple):
            path, holder, reason = r
            broken.append(_finding("not-a-holder", path, holder, reason, _direct_params(holder), {}))
            continue
        entries.append((order.get(r.structure.experts_path, len(order)), _holder_entry(r)))
    entries.sort(key=lambda e: e[0])
    groups = _group([e for _, e in entries])
    moe_paths = {p for g in groups for p in g["paths"]}
    all_paths = [name for name, _ in model.named_modules() if name]
    for g in groups:
        globs = {path_glob(p) for p in g["paths"]}
        untouched = [
            p for p in all_paths if p not in moe_paths and any(_same_level_match(p, gl) for gl in globs)
        ]
        _finish_group(g, untouched)
    found = _non_contract(model, config, holders) + broken
    non_contract = _group([(_finding_key(f), f) for f in found])
    for f in non_contract:
        f["structure"]["paths_glob"] = sorted({path_glob(p) for p in f["paths"]})
    doc = {
        "model_type": getattr(config, "model_type", None),
        "model_class": type(model).__name__,
        "groups": groups,
        "non_contract": non_contract,
    }
    if note:
        doc["note"] = note
    if not groups and not non_contract:
        doc["message"] = (
            f"no MoE blocks found in {type(model).__name__}: no experts holder, no per-expert weights and no "
            "router with one logit per expert; nothing for hp-rewrite to do (train it data-parallel as is)"
        )
    return doc


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_meta_model(config) -> tuple[nn.Module, str | None]:
    """The model on the meta device as ``apply`` builds it (:func:`hp_rewrite.commands.meta_model`);
    for a config those Auto classes reject, the model class its modeling module declares, with a
    note saying so. Raises UserError when neither builds."""
    import torch

    from ..commands import UserError, meta_model

    try:
        return meta_model(config), None
    except Exception as first:  # noqa: BLE001 - transformers raises many kinds here
        from ..loading.tiny import TinyError, auto_class_for

        try:
            cls = auto_class_for(config)
        except TinyError:
            cls = None
        if cls is None or "Unrecognized configuration class" not in str(first):
            raise UserError(
                f"transformers cannot build the model from this config ({_short(first)}); "
                "fix the config (or report it upstream) and retry"
            ) from first
        try:
            with torch.device("meta"):
                build = getattr(cls, "from_config", None) or cls._from_config
                model = build(config, attn_implementation="eager")
        except Exception as e:  # noqa: BLE001
            raise UserError(
                f"transformers cannot build the model from this config: AutoModelForCausalLM / AutoModel do "
                f"not take it, and {cls.__name__} raised {_short(e)}; fix the config (or report it "
                "upstream) and retry"
            ) from e
        note = (
            f"described from {type(model).__name__}, built directly: `hp-rewrite apply` builds models with "
            f"AutoModelForCausalLM / AutoModel, which cannot build this config ({_short(first, 160)})"
        )
        return model, note


def describe_moe(model_dir: Path, as_json: bool) -> int:
    """``hp-rewrite describe-moe MODEL_DIR [--json]``: exit 0 with a report (also when there is no MoE)."""
    import json

    from ..commands import UserError, load_config

    with quiet_transformers():
        config = load_config(Path(model_dir))
        try:
            model, note = build_meta_model(config)
        except UserError as e:
            raise UserError(f"{model_dir}/config.json: {e}") from e
    doc = describe(model, config)
    if note:
        doc["note"] = f"{doc['note']}; {note}" if doc.get("note") else note
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        print_report(doc)
    return 0


# -- console rendering -----------------------------------------------------------------------------


def _shapes(params: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in params.items()) or "none"


def print_report(doc: dict) -> None:
    from rich.markup import escape as esc
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.tree import Tree

    from ..commands import console

    groups, bad = doc["groups"], doc["non_contract"]
    if doc.get("note"):
        console.print(f"[yellow]note:[/] {esc(doc['note'])}", highlight=False)
    if "message" in doc:
        console.print(f"[bold]{doc['model_type']}[/]: {esc(doc['message'])}", highlight=False)
        return
    n_blocks = sum(len(g["paths"]) for g in groups)
    n_bad = sum(len(f["paths"]) for f in bad)
    head = (
        f"{n_blocks} MoE block(s) in {len(groups)} group(s)"
        if groups
        else "no MoE block hp-rewrite can rewrite"
    )
    if bad:
        head += f"; {n_bad} MoE-like module(s) hp-rewrite does not support ({UNTOUCHED})"
    console.print(f"[bold]{doc['model_type']}[/] ({doc['model_class']}): {esc(head)}", highlight=False)
    for g in groups:
        st, a = g["structure"], g["archetype"]
        status = "[green]matched[/]" if a else "[yellow]unmatched[/]"
        tree = Tree(f"{status} [bold]{g['class']}[/] x{len(g['paths'])}  {esc(compact_paths(g['paths']))}")
        tree.add(esc("children: " + ", ".join(f"{c['name']} ({c['class']})" for c in g["children"])))
        tree.add(esc("params: " + _shapes(g["params"])))
        node = tree.add("structure")
        router = (
            f"{st['router']} ({st['router_class']})"
            if st["router"]
            else "- (no child with weight [experts, hidden])"
        )
        node.add(esc(f"router: {router}"))
        top_k = st["top_k"] if st["top_k"] is not None else "?"
        node.add(
            esc(
                f"experts: {st['experts']} ({st['experts_class']}), layout {st['layout']}, "
                f"{st['num_experts']} experts, hidden {st['hidden_size']}, top-k {top_k}"
            )
        )
        node.add(esc(f"shared expert: {st['shared'] or '-'}"))
        node.add(esc(f"shared gate: {st['shared_gate'] or '-'}"))
        node.add(esc(f"other children: {', '.join(st['others']) or '-'}"))
        if a:
            arch = tree.add(
                f"archetype: [green]{a['level']}-level[/], router {a['router']}, shared {a['shared']}, "
                f"layout {a['layout']}"
            )
            if a["level"] == "experts" and g["tried"]:
                why = arch.add("block level not used:")
                for t in g["tried"]:
                    why.add(esc(t), highlight=False)
        else:
            reason = tree.add("[yellow]no archetype fits[/]; the block is " + UNTOUCHED)
            for why in g["reason"].split("; "):
                reason.add(esc(why), highlight=False)
            tree.add(esc(f"what to do: {g['action']}"))
        console.print(tree, highlight=False)
        console.print(Panel(Syntax(g["plan_snippet"], "yaml"), title="plan to start from", expand=False))
    for f in bad:
        tree = Tree(
            f"[red]not supported[/] [bold]{f['class']}[/] x{len(f['paths'])}  {esc(compact_paths(f['paths']))}"
        )
        tree.add(
            esc("children: " + (", ".join(f"{c['name']} ({c['class']})" for c in f["children"]) or "none"))
        )
        tree.add(esc("params: " + _shapes(f["params"])))
        tree.add(esc(f"why: {f['reason']}"))
        tree.add(esc(f"what to do: {f['action']}"))
        console.print(tree, highlight=False)
