"""What hp-rewrite sees in a model and what it would do with it, as typed records (``describe-moe``).

:func:`diagnose` looks at a model built on the meta device, by structure, never by model name:

* **experts holders**: their blocks are analysed and matched exactly as ``apply`` does
  (:func:`hp_rewrite.match.analysis.analyze` with the default plan, in the mode that records errors instead
  of raising), giving an archetype or the reason none fits, plus a plan snippet to start from. A
  block too big to probe (:mod:`~hp_rewrite.match.probe_size`) is confirmed on the same block class
  in a shrunk copy of the config.
* **modules that look like MoE but do not follow the experts contract**
  (:mod:`~hp_rewrite.match.misfits`), left untouched, each with the reason and what to do.

Identical blocks (same class, same structure, same shapes, same outcome) are grouped into one
:class:`BlockGroup` listing every path, so a 48-layer model reads compactly. :meth:`Diagnosis.to_json`
is the ``describe-moe --json`` document; the CLI renders the same records as text.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from torch import nn

from ..errors import SelectionError
from ..hf import is_remote_config, meta_model, quiet_transformers, short_error, top_k_of
from ..hf.shrink import tiny_config
from ..plan import DEFAULT_PLAN
from .archetype import Archetype, MatchResult, layout_name
from .misfits import (
    Children,
    Misfit,
    Shapes,
    broken_holder,
    children_from_json,
    children_json,
    children_of,
    direct_params,
    find_misfits,
    group_misfits,
    parent_of,
    shapes_from_json,
    shapes_json,
)
from .probe_size import largest_block_params, too_big_to_probe
from .snippets import (
    ACTIONS,
    UNTOUCHED,
    compact_paths,
    ep_size_for,
    path_glob,
    plan_snippet,
    same_level_match,
)
from .structure import (
    describe_expert_modules,
    experts_layout,
    find_blocks,
    find_experts_holders,
    nested_router,
    selection_bias,
)


@dataclass(frozen=True)
class BlockFacts:
    """The structure of a MoE block (its ``structure`` in the JSON document): attribute names on the block."""

    router: str | None
    router_class: str | None
    experts: str
    experts_class: str
    layout: str  # the experts weight layout (layout_name)
    num_experts: int
    hidden_size: int
    top_k: int | None
    shared: str | None
    shared_gate: str | None
    others: tuple[str, ...]  # children that fit no role
    router_inside: str | None = None  # no router child: the router Linear inside another child (router.classifier)
    expert_modules: str | None = None  # experts held as modules: class, count, roles, activation
    selection_bias: str | None = None  # the router's selection bias (routing.bias_update_rate moves it)

    def as_dict(self) -> dict:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> BlockFacts:
        return cls(**{**d, "others": tuple(d["others"])})


@dataclass(frozen=True)
class ArchetypeChoice:
    """The archetype confirmed for a block class, as reported (:class:`~hp_rewrite.match.archetype.Archetype`
    without the code-generation parts)."""

    level: str  # block | experts
    router: str
    shared: str
    layout: str
    names: tuple[tuple[str, str], ...]  # template placeholder -> the block's attribute
    extra: tuple[tuple[str, object], ...] = ()  # an extension's label and sources hash

    @classmethod
    def of(cls, a: Archetype) -> ArchetypeChoice:
        d = a.as_dict()
        core = [d.pop(k) for k in ("level", "router", "shared", "layout")]
        return cls(*core, names=tuple(a.names.items()), extra=tuple(d.items()))

    def as_dict(self) -> dict:
        return {"level": self.level, "router": self.router, "shared": self.shared, "layout": self.layout,
                **dict(self.extra), "names": dict(self.names)}

    @classmethod
    def from_dict(cls, d: dict) -> ArchetypeChoice:
        core = ("level", "router", "shared", "layout", "names")
        return cls(d["level"], d["router"], d["shared"], d["layout"], tuple(d["names"].items()),
                   tuple((k, v) for k, v in d.items() if k not in core))


@dataclass(frozen=True)
class BlockGroup:
    """Identical MoE blocks (one class, structure, shapes and outcome) at ``paths``."""

    paths: tuple[str, ...]
    block_class: str
    children: Children
    params: Shapes  # the block's own parameters and its experts holder's
    facts: BlockFacts
    archetype: ArchetypeChoice | None  # None: no archetype fits, see ``reason``
    reason: str | None
    tried: tuple[str, ...]  # the candidates rejected, and why
    action: str | None  # what to do when unmatched
    plan_snippet: str = ""

    @property
    def matched(self) -> bool:
        return self.archetype is not None

    def as_dict(self) -> dict:
        return {
            "paths": list(self.paths),
            "class": self.block_class,
            "children": children_json(self.children),
            "params": shapes_json(self.params),
            "structure": self.facts.as_dict(),
            "archetype": None if self.archetype is None else self.archetype.as_dict(),
            "reason": self.reason,
            "tried": list(self.tried),
            "action": self.action,
            "plan_snippet": self.plan_snippet,
        }

    @classmethod
    def from_dict(cls, d: dict) -> BlockGroup:
        a = d["archetype"]
        archetype = None if a is None else ArchetypeChoice.from_dict(a)
        return cls(tuple(d["paths"]), d["class"], children_from_json(d["children"]), shapes_from_json(d["params"]),
                   BlockFacts.from_dict(d["structure"]), archetype, d["reason"], tuple(d["tried"]), d["action"],
                   d["plan_snippet"])


@dataclass(frozen=True)
class Diagnosis:
    """Everything ``describe-moe`` reports about one model."""

    model_type: str | None
    model_class: str
    groups: tuple[BlockGroup, ...]  # the MoE blocks hp-rewrite can rewrite (or matched but unfit)
    misfits: tuple[Misfit, ...]  # MoE-like modules left untouched (``non_contract``)
    notes: tuple[str, ...] = ()  # how the diagnosis was obtained (shrunk copy, model built directly)
    checkpoint: str | None = None  # how a quantised checkpoint is read (MXFP4 / block FP8, dequantised to what)

    @property
    def note(self) -> str | None:
        return "; ".join(self.notes) or None

    @property
    def message(self) -> str | None:
        """Set when there is nothing MoE at all."""
        if self.groups or self.misfits:
            return None
        return (
            f"no MoE blocks found in {self.model_class}: no experts holder, no per-expert weights and no "
            "router with one logit per expert; nothing for hp-rewrite to do (train it data-parallel as is)"
        )

    def with_checkpoint(self, checkpoint: str | None) -> Diagnosis:
        return replace(self, checkpoint=checkpoint)

    def to_json(self) -> dict:
        """The ``describe-moe --json`` document."""
        doc = {
            "model_type": self.model_type,
            "model_class": self.model_class,
            "groups": [g.as_dict() for g in self.groups],
            "non_contract": [f.as_dict() for f in self.misfits],
        }
        if self.note:
            doc["note"] = self.note
        if self.checkpoint:
            doc["checkpoint"] = self.checkpoint
        if self.message:
            doc["message"] = self.message
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> Diagnosis:
        """The records of a ``describe-moe --json`` document (archetype constants are not in it)."""
        return cls(doc["model_type"], doc["model_class"], tuple(BlockGroup.from_dict(g) for g in doc["groups"]),
                   tuple(Misfit.from_dict(f) for f in doc["non_contract"]),
                   (doc["note"],) if doc.get("note") else (), doc.get("checkpoint"))


# -- matching ----------------------------------------------------------------------------------------


def _analyze(model: nn.Module):
    """``apply``'s analysis with the default plan, recording errors instead of raising."""
    from .analysis import analyze

    return analyze(model, DEFAULT_PLAN, collect_errors=True)


def _class_key(s) -> tuple:
    return type(s.block), s.experts_name, type(s.experts)


def _match_via_small_copy(model: nn.Module, config, size: int) -> tuple[list[MatchResult], str]:
    """Blocks too large to probe: the structure comes from ``model``, the archetype of each block class
    from the same classes in a shrunk copy of ``config`` (same code paths, tiny sizes). ``size``: bytes."""
    gib = f"{size / 2**30:.1f} GiB"
    try:
        small = _analyze(meta_model(tiny_config(config)))
        known = {_class_key(r.structure): r for r in small.matched + small.unmatched}
        why = ""
    except Exception as e:  # noqa: BLE001 - the shrunk copy is a convenience; say why it failed
        known, why = {}, short_error(e)
    out = []
    for s in find_blocks(model):
        r = known.get(_class_key(s))
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


# -- experts holders (the contract) --------------------------------------------------------------------


def _block_group(r: MatchResult) -> tuple[tuple, BlockGroup]:
    """The one-path group of a match result, and the key identical blocks share."""
    s = r.structure
    router = s.block.get_submodule(s.router_name) if s.router_name else None
    # a router Linear inside a router module (JetMoE's router.layer): the module declares the top-k
    router_module = s.block.get_submodule(s.router_name.split(".")[0]) if s.router_name else None
    held = experts_layout(s.experts).weight_names if s.self_held else ()
    facts = BlockFacts(
        router=s.router_name,
        router_class=type(router).__name__ if router is not None else None,
        experts=" + ".join(held) + " (the block holds them)" if s.self_held else s.experts_name,
        experts_class=type(s.experts).__name__,
        layout=layout_name(s.experts),
        num_experts=s.num_experts,
        hidden_size=s.hidden_size,
        top_k=top_k_of(s.block, router) or top_k_of(s.block, router_module),
        shared=s.shared_name,
        shared_gate=s.shared_gate_name,
        others=tuple(s.others),
        router_inside=nested_router(s),
        expert_modules=describe_expert_modules(s),
        selection_bias=".".join(p for p in (selection_bias(s) or ()) if p) or None,
    )
    tried = list(r.tried)
    if r.archetype is not None and r.archetype.level == "experts" and not tried:
        tried.append(
            f"block level: no candidate for the router `{s.router_name}`: its forward(hidden) does not return "
            "(logits, top_k_weights, top_k_index)"
        )
    matched = r.archetype is not None
    group = BlockGroup(
        paths=(s.path or s.experts_path,),
        block_class=type(s.block).__name__,
        children=children_of(s.block),
        params=direct_params(s.block) + (() if s.self_held else direct_params(s.experts, f"{s.experts_name}.")),
        facts=facts,
        archetype=None if r.archetype is None else ArchetypeChoice.of(r.archetype),
        reason=None if matched else (r.reason or "no archetype reproduces the block"),
        tried=tuple(tried),
        action=None if matched else ACTIONS["unmatched"],
    )
    key = (type(s.block), type(s.experts), group.children, group.params, facts, group.archetype, group.reason)
    return key, group


def _with_snippet(g: BlockGroup, untouched: list[str]) -> BlockGroup:
    """``g`` with its plan snippet; ``untouched`` are module paths the glob also matches that are no MoE block."""
    globs = list(dict.fromkeys(path_glob(p) for p in g.paths))
    n = g.facts.num_experts
    experts_level = g.archetype is not None and g.archetype.level == "experts"
    if g.archetype is not None:
        how = (
            "only the experts call is rewritten (the block keeps its own forward)"
            if experts_level
            else "the whole block forward is rewritten"
        )
        ep = ep_size_for(n)
        comment = f"{g.block_class}: {n} experts, {n // ep} per rank at ep_size {ep}; {how}"
    else:
        comment = (
            f"{g.block_class}: no archetype fits yet (see the reason); with this plan the block is\n"
            f"reported unmatched and {UNTOUCHED} until an extension handles it:\n"
            "extensions: [my_package.my_archetype]"
        )
    if untouched:
        comment += (
            f"\nthe glob also matches {len(untouched)} module(s) that are not MoE blocks ({compact_paths(untouched)}):"
            "\nthose (e.g. dense MLP layers) are never touched"
        )
    return replace(g, plan_snippet=plan_snippet(globs, n, experts_level, comment))


def _group_blocks(model: nn.Module, results: list[MatchResult], holders: list[str]) -> list[BlockGroup]:
    order = {p: i for i, p in enumerate(holders)}
    ranked = sorted(results, key=lambda r: order.get(r.structure.experts_path, len(order)))
    same: dict[tuple, list[BlockGroup]] = {}
    for r in ranked:
        key, group = _block_group(r)
        same.setdefault(key, []).append(group)
    groups = [replace(gs[0], paths=tuple(p for g in gs for p in g.paths)) for gs in same.values()]
    moe_paths = {p for g in groups for p in g.paths}
    all_paths = [name for name, _ in model.named_modules() if name]
    out = []
    for g in groups:
        globs = {path_glob(p) for p in g.paths}
        untouched = [p for p in all_paths if p not in moe_paths and any(same_level_match(p, gl) for gl in globs)]
        out.append(_with_snippet(g, untouched))
    return out


# -- the diagnosis -------------------------------------------------------------------------------------


def _block_of(model: nn.Module, holder_path: str) -> nn.Module:
    parent = parent_of(model, holder_path)[1]
    return model if parent is None else parent


def diagnose(model: nn.Module, config) -> Diagnosis:
    """The diagnosis of a model built from ``config`` (normally on the meta device; ``config`` may be None)."""
    holders = [name for name, _ in find_experts_holders(model)]
    notes: list[str] = []
    failed = []
    with quiet_transformers():
        size = largest_block_params(_block_of(model, p) for p in holders)
        if too_big_to_probe(size):
            results, note = _match_via_small_copy(model, config, size * 4)
            notes.append(note)
        else:
            analysis = _analyze(model)
            results, failed = analysis.matched + analysis.unmatched, analysis.failed
    groups = _group_blocks(model, results, holders)
    found = find_misfits(model, config, holders) + [broken_holder(f.path, f.holder, f.reason) for f in failed]
    return Diagnosis(getattr(config, "model_type", None), type(model).__name__, tuple(groups),
                     tuple(group_misfits(found)), tuple(notes))


def describe(model: nn.Module, config) -> dict:
    """The ``describe-moe --json`` document of a model built from ``config``."""
    return diagnose(model, config).to_json()


# -- a plan that rewrites nothing ---------------------------------------------------------------------


def nothing_to_rewrite(model: nn.Module, plan, config=None, analysis=None, source=None) -> SelectionError:
    """The error for a plan that rewrites no block of ``model``: each candidate found and why it was not
    matched, as ``describe-moe`` reports it. Raised before anything is written or installed, so a model
    is never marked expert-parallel while every rank still holds every expert. ``analysis``: the plan's
    analysis of ``model`` when the caller has it; ``source``: the checkpoint, for the suggested command."""
    from .analysis import analyze

    if analysis is None:
        with quiet_transformers():
            analysis = analyze(model, plan, collect_errors=True)
    holders = [name for name, _ in find_experts_holders(model)]
    found = find_misfits(model, config, holders) + [broken_holder(f.path, f.holder, f.reason) for f in analysis.failed]
    lines = []
    by_reason: dict[tuple[str, str], list[str]] = {}
    for r in analysis.unmatched:
        by_reason.setdefault((type(r.structure.block).__name__, r.reason or "no archetype reproduces it"),
                             []).append(r.structure.path)
    for (cls, reason), paths in by_reason.items():
        lines.append(f"{compact_paths(paths)} ({cls}): unmatched: {reason}")
    for m in group_misfits(found):
        lines.append(f"{compact_paths(m.paths)} ({m.module_class}): {m.reason}; to do: {m.action}")
    if analysis.excluded:
        shown = ", ".join(analysis.excluded[:3]) + (", ..." if len(analysis.excluded) > 3 else "")
        lines.append(
            f"modules.include {plan.modules.include} / exclude {plan.modules.exclude} select none of the "
            f"{len(analysis.excluded)} MoE blocks ({shown}): match their paths or class names"
        )
    where = f"hp-rewrite describe-moe {source}" if source else "hp-rewrite describe-moe MODEL_DIR"
    if config is not None and is_remote_config(config):
        where += " --trust-remote-code"
    head = f"the plan rewrites no MoE block of {type(model).__name__}, so it would not be expert-parallel"
    if not lines:
        return SelectionError(
            f"{head}: no MoE block in this {getattr(config, 'model_type', None) or 'model'} model, nothing to "
            f"rewrite (`{where}` shows what hp-rewrite looks for); load it without hp-rewrite"
        )
    found_text = "".join(f"\n  - {line}" for line in lines)
    return SelectionError(f"{head} (every rank would hold every expert). Found:{found_text}\n"
                          f"`{where}` shows each with its structure.")
