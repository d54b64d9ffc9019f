"""Move modules of hp_rewrite to new paths and rewrite every import of them (the runtime's rooms, #57).

    python tools/move_modules.py group      # one step of STEPS: git mv, imports, strings, docs

For each step: ``git mv`` its modules (writing each new package's ``__init__.py`` with a docstring),
then, in every .py under hp_rewrite/, tests/, tools/ and examples/, resolve each import to an absolute
module name from the file's old place and write it back pointing at the new one (relative imports stay
relative, to the file's new package; ``from pkg import moved_module`` is followed too); string literals
naming a moved module (``"hp_rewrite.runtime.routing.replay:..."`` in lazy maps, importlib calls) and the
module paths in the docs are rewritten the same way. Imports then get sorted by ruff. What it cannot
see (attribute access on a package alias, files read by path) the checks after each step catch.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import libcst as cst

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("hp_rewrite", "tests", "tools", "examples")
DOCS = ("README.md", "docs")
R = "hp_rewrite.runtime"

#: step -> (new package -> its docstring, {old module: new module})
STEPS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "group": ({f"{R}.group": "The EP group and where experts live: meshes, groups, placement, the TP token share."},
              {f"{R}.groups": f"{R}.group.groups", f"{R}.tokens": f"{R}.group.tokens"}),
    "transport": ({f"{R}.transport": "Moving rows between ranks: the all-to-all with autograd, fixed-order row "
                   "gathers and sums, deduplication, the exchange protocol and its implementations."},
                  {f"{R}.{m}": f"{R}.transport.{m}" for m in ("comm", "rows", "dedup", "exchange")}),
    "overlap": ({f"{R}.overlap": "Work beside the exchange: deferred expert weight gradients, micro-batches "
                 "taking turns, a model's exchange runtime."},
                {f"{R}.{m}": f"{R}.overlap.{m}" for m in ("deferred", "turns", "context")}),
    "compute": ({f"{R}.compute": "The local experts: their grouped-GEMM compute for every weight layout, their "
                 "rows, experts held as modules or kept quantised."},
                {f"{R}.{m}": f"{R}.compute.{m}"
                 for m in ("experts", "batch", "grouped_op", "stacked", "quantized", "expert_modules")}),
    "routing": ({f"{R}.routing": "Routing: the routers, replay of recorded choices, the counts of what they "
                 "chose, the load-balancing and z-losses."},
                {f"{R}.{m}": f"{R}.routing.{m}" for m in ("routers", "replay", "routing_load", "aux_loss")}),
    "pipeline": ({f"{R}.pipeline": "What generated code calls: dispatch -> local experts -> combine, capacity, "
                  "zero experts, the input-scaled variant, the shared expert's merge."},
                 {f"{R}.{m}": f"{R}.pipeline.{m}"
                  for m in ("dispatch", "capacity", "zero_experts", "input_scaled", "shared")}),
    "binding": ({f"{R}.binding": "A holder made expert-parallel: its binding, installed once."},
                {f"{R}.install": f"{R}.binding.install"}),
    "sync": ({"hp_rewrite.sync": "Gradient synchronisation, between the runtime and the engines: the EP x DP "
              "gradient contract, grad norms that count rank-local experts once, the engine guard, lockstep "
              "generation."},
             {f"{R}.{m}": f"hp_rewrite.sync.{m}" for m in ("gradients", "gradnorm", "engines", "generation")}),
    "face": ({}, {}),  # nothing moves: the runtime's face shrinks to what generated code calls (NAMES)
}
#: step -> the names a package stops exporting in it, and where they are defined now
NAMES: dict[str, dict[str, dict[str, str]]] = {
    "sync": {R: {n: "hp_rewrite.sync.gradients" for n in ("sync_gradients", "GradientSync", "expert_parameters",
                                                         "has_tuner_layers", "rank_local_names",
                                                         "rank_local_parameters")}},
    "face": {R: {
        **{n: f"{R}.binding.install" for n in ("ExpertParallelBinding", "exchange_runtimes", "expert_weights",
                                               "install_expert_parallel", "local_rows")},
        **{n: f"{R}.compute.experts" for n in ("ExpertsLayout", "experts_implementation_of", "holder_of",
                                               "kernel_choice", "local_experts_forward", "resolve_compute",
                                               "keep_local_experts")},
        "LocalBatch": f"{R}.compute.batch",
        "expert_modules": f"{R}.compute",
        "ExpertParallelError": f"{R}.errors",
        **{n: f"{R}.group.groups" for n in ("ExpertParallelGroup", "ExpertPlacement", "build_expert_parallel_group")},
        "RuntimeOptions": f"{R}.options",
        "ExchangeRuntime": f"{R}.overlap.context",
        **{n: f"{R}.overlap.turns" for n in ("Interleaver", "interleave")},
        **{n: f"{R}.pipeline.capacity" for n in ("CapacityResult", "apply_capacity", "expert_capacity")},
        **{n: f"{R}.pipeline.dispatch" for n in ("DispatchStats", "RoutedDispatch", "moe_forward")},
        "SHARED_MODES": f"{R}.pipeline.shared",
        "RouterOutput": f"{R}.routing.routers",
        **{n: f"{R}.transport.comm" for n in ("PendingExchange", "WaitHooks", "all_to_all", "all_to_all_async")},
        **{n: f"{R}.transport.exchange" for n in ("DedupExchange", "PerSlotExchange", "TokenExchange",
                                                  "exchange_for")},
    }},
}


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def dotted(node) -> str:
    if node is None:
        return ""
    if isinstance(node, cst.Name):
        return node.value
    return f"{dotted(node.value)}.{node.attr.value}"


def as_node(name: str):
    parts = name.split(".")
    node = cst.Name(parts[0])
    for p in parts[1:]:
        node = cst.Attribute(node, cst.Name(p))
    return node


def relative(target: str, package: str) -> tuple[int, str]:
    """``target`` as a relative import from ``package``: (dots, module)."""
    t, p = target.split("."), package.split(".")
    common = 0
    while common < min(len(t), len(p)) and t[common] == p[common]:
        common += 1
    return len(p) - common + 1, ".".join(t[common:])


def _exports(package: str) -> set[str]:
    """The names ``package``'s ``__init__.py`` binds by ``from .module import name`` (not submodules)."""
    init = ROOT / package.replace(".", "/") / "__init__.py"
    if not init.exists():
        return set()
    names = set()
    for node in cst.parse_module(init.read_text()).body:
        for stmt in node.body if isinstance(node, cst.SimpleStatementLine) else ():
            if isinstance(stmt, cst.ImportFrom) and stmt.module is not None and not isinstance(stmt.names, cst.ImportStar):
                names |= {dotted(a.asname.name if a.asname else a.name) for a in stmt.names}
    return names


class Rewrite(cst.CSTTransformer):
    """``moves``: old module -> new module; ``names``: package -> {name it no longer exports: the module
    that defines it} (imports of those names from the package go to that module)."""

    def __init__(self, moves: dict[str, str], old_package: str, new_package: str,
                 names: dict[str, dict[str, str]] | None = None) -> None:
        self.moves, self.old_package, self.new_package = moves, old_package, new_package
        self.names = names or {}

    def _moved(self, name: str) -> str | None:
        for old, new in self.moves.items():
            if name == old or name.startswith(old + "."):
                return new + name[len(old):]
        return None

    def _emit(self, node: cst.ImportFrom, target: str, level: int) -> cst.ImportFrom:
        if level == 0:
            return node.with_changes(module=as_node(target), relative=())
        dots, mod = relative(target, self.new_package)
        return node.with_changes(module=as_node(mod) if mod else None, relative=[cst.Dot()] * dots)

    def leave_ImportFrom(self, original: cst.ImportFrom, node: cst.ImportFrom):
        level = len(node.relative)
        base = dotted(node.module)
        if level:
            pkg = self.old_package.split(".")
            pkg = pkg[: len(pkg) - (level - 1)]
            source = ".".join(pkg + ([base] if base else []))
        else:
            source = base
        if not source.startswith("hp_rewrite"):
            return node
        moved = self._moved(source)
        if moved is not None:
            return self._emit(node, moved, level)
        if isinstance(node.names, cst.ImportStar):
            return self._emit(node, source, level) if level else node
        # ``from pkg import module``: a moved submodule goes with its new package
        groups: dict[str, list[cst.ImportAlias]] = {}
        exported = _exports(source)
        for alias in node.names:
            # a name the package binds itself (hp_rewrite.runtime.dispatch, the function) is not its submodule
            sub = None if dotted(alias.name) in exported else self._moved(f"{source}.{dotted(alias.name)}")
            home = self.names.get(source, {}).get(dotted(alias.name))
            groups.setdefault(sub.rpartition(".")[0] if sub else home or source, []).append(alias)
        if len(groups) == 1 and source in groups:
            return self._emit(node, source, level) if level else node
        out = []
        for target, aliases in groups.items():
            aliases = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in aliases]
            out.append(self._emit(node.with_changes(names=aliases, lpar=None, rpar=None), target, level))
        return cst.FlattenSentinel(out)

    def leave_Import(self, original: cst.Import, node: cst.Import):
        names = []
        for alias in node.names:
            moved = self._moved(dotted(alias.name))
            names.append(alias.with_changes(name=as_node(moved)) if moved else alias)
        return node.with_changes(names=names)

    def leave_SimpleString(self, original: cst.SimpleString, node: cst.SimpleString):
        text = node.value
        for old, new in self.moves.items():
            text = re.sub(re.escape(old) + r"(?=[:.\"'])", new, text)
        return node.with_changes(value=text)


def rewrite_sources(moves: dict[str, str], moved_files: dict[Path, Path],
                    names: dict[str, dict[str, str]] | None = None) -> list[Path]:
    changed = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if ".venv" in path.parts:
                continue
            new_path = moved_files.get(path, path)
            is_pkg = path.name == "__init__.py"
            old_mod, new_mod = module_of(path), module_of(new_path)
            text = path.read_text()
            tree = cst.parse_module(text)
            out = tree.visit(Rewrite(moves, package_of(old_mod, is_pkg), package_of(new_mod, is_pkg), names)).code
            if out != text:
                path.write_text(out)
                changed.append(path)
    return changed


def rewrite_docs(moves: dict[str, str]) -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "hp_rewrite").rglob("*.py")),
             *sorted((ROOT / "tests").rglob("*.py"))]
    for path in files:
        text = path.read_text()
        out = text
        for old, new in moves.items():
            old_path, new_path = old.replace(".", "/"), new.replace(".", "/")
            out = re.sub(r"\b" + re.escape(old_path) + r"\.py\b", new_path + ".py", out)
            short_old, short_new = old_path.removeprefix("hp_rewrite/"), new_path.removeprefix("hp_rewrite/")
            out = re.sub(r"(?<![\w/])" + re.escape(short_old) + r"\.py\b", short_new + ".py", out)
            out = re.sub(r"\b" + re.escape(old) + r"\b", new, out)
        if out != text:
            path.write_text(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=list(STEPS))
    args = parser.parse_args(argv)
    packages, moves = STEPS[args.step]
    file_of = {m: ROOT / (m.replace(".", "/") + ".py") for m in [*moves, *moves.values()]}
    moved_files = {file_of[old]: file_of[new] for old, new in moves.items()}
    missing = [str(p) for p in moved_files if not p.exists()]
    if missing:
        print(f"step {args.step}: not found (moved already?): {missing}", file=sys.stderr)
        return 2
    rewrite_sources(moves, moved_files, NAMES.get(args.step))
    rewrite_docs(moves)
    pyproject = ROOT / "pyproject.toml"
    for package, doc in packages.items():
        init = ROOT / (package.replace(".", "/")) / "__init__.py"
        init.parent.mkdir(parents=True, exist_ok=True)
        if not init.exists():
            init.write_text(f'"""{doc}"""\n')
            subprocess.run(["git", "add", str(init)], cwd=ROOT, check=True)
        listed = pyproject.read_text()
        if f'"{package}",' not in listed:  # the wheel ships every package (tests/test_layers.py checks it)
            parent = package.rpartition(".")[0]
            anchor = f'    "{parent}",\n' if f'    "{parent}",\n' in listed else '    "hp_rewrite",\n'
            pyproject.write_text(listed.replace(anchor, anchor + f'    "{package}",\n', 1))
    for old, new in moved_files.items():
        subprocess.run(["git", "mv", str(old), str(new)], cwd=ROOT, check=True)
    subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "I", "--fix", "--quiet", "."], cwd=ROOT)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
