"""What describe-moe suggests: the plan snippet for a block group, what to do with a module it leaves
untouched, and module paths as globs and compact lists."""

from __future__ import annotations

from fnmatch import fnmatchcase

UNTOUCHED = "left untouched by hp-rewrite"
_DATA_PARALLEL = "run it data-parallel (every rank keeps all experts; hp-rewrite needs no plan entry for it)"
_EXTENSION = "or write an archetype extension for it (a Python module named under the plan's `extensions:`)"

#: what the user can do, per kind of misfit (and for an unmatched experts holder)
ACTIONS = {
    "unequal-expert-dims": (
        f"{_DATA_PARALLEL}, {_EXTENSION} (or an adapter exposing the weights as gate_up_proj [E+Z, 2I, H] + "
        "down_proj [E, H, I] with forward(hidden, top_k_index, top_k_weights) if the extra ids are identity experts)"
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


def path_glob(path: str) -> str:
    """The module path with every numeric component replaced by ``*`` (``model.layers.*.mlp``)."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def same_level_match(path: str, glob: str) -> bool:
    """``glob`` matches ``path`` component by component (not a descendant of a matching module)."""
    parts, pattern = path.split("."), glob.split(".")
    return len(parts) == len(pattern) and all(fnmatchcase(a, b) for a, b in zip(parts, pattern, strict=True))


def compact_paths(paths: list[str] | tuple[str, ...]) -> str:
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


def plan_snippet(globs: list[str], num_experts: int, experts_level: bool, comment: str = "") -> str:
    """A minimal YAML plan selecting ``globs``, with ``comment`` as its leading ``#`` lines."""
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    lines += ["version: 1", f"ep_size: {ep_size_for(num_experts)}", "modules:", "  include:"]
    lines += [f"    - {g}" for g in globs]
    if experts_level:
        lines += ["archetype:", "  router: auto", "  shared: auto", "  level: experts"]
    else:
        lines.append("archetype: auto")
    return "\n".join(lines) + "\n"
