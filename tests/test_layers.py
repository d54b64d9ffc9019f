"""The house rules of the package, checked on its source: imports run down the layers, no circles,
no module over 600 lines. docs/architecture.md draws the same layers."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hp_rewrite"

#: bottom to top; a unit may import units of lower layers only (the root package holds only __version__)
LAYERS = (
    ("__init__", "errors"),
    ("launch",),
    ("hf",),
    ("kernels",),
    ("runtime",),
    ("tensor", "context"),
    ("plan",),
    ("sync",),
    ("codegen",),
    ("match",),
    ("loading",),
    ("training", "tiny", "rewrite", "verify", "apply"),
    ("cost",),
    ("cli",),
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _walk_at_run_time(tree: ast.AST):
    """``ast.walk`` without ``if TYPE_CHECKING:`` blocks: imports for type readers never run."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
            else:
                todo.append(child)


def _imports(name: str, path: Path) -> set[str]:
    """Every hp_rewrite module ``name`` imports, at module level or inside functions."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in _walk_at_run_time(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "hp_rewrite":
                submodules = {f"{target}.{a.name}" for a in node.names} & set(_modules())
                if len(submodules) < len(node.names):  # names of ``target``, not only its submodules
                    found.add(target)
                found.update(submodules)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "hp_rewrite")
    modules = _modules()
    return {t for t in found if t in modules and t != name}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_layer() -> None:
    units = {_unit(m) for m in _modules()}
    assert units <= set(LAYER_OF), f"add {sorted(units - set(LAYER_OF))} to LAYERS (and docs/architecture.md)"


def test_imports_run_down_the_layers() -> None:
    upward = []
    for name, path in _modules().items():
        src = _unit(name)
        for target in _imports(name, path):
            dst = _unit(target)
            if dst != src and LAYER_OF.get(dst, -1) >= LAYER_OF.get(src, -1):
                upward.append(f"{name} -> {target}")
    assert not upward, "imports that run up (or across) a layer:\n" + "\n".join(sorted(upward))


def test_no_import_circles() -> None:
    graph = {name: _imports(name, path) for name, path in _modules().items()}
    # a package's __init__ re-exporting its own modules is not a circle: drop edges from a module to its packages
    graph = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_no_module_is_over_600_lines() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_every_package_ships_in_the_wheel() -> None:
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


#: the runtime's rooms, bottom to top (docs/architecture.md); a room imports only from rooms below it (its floor:
#: errors, options), never from the runtime's face (hp_rewrite.runtime itself, which re-exports from them)
ROOMS = (("errors", "installed"), ("options",), ("group", "transport", "routing"), ("overlap",), ("compute",),
         ("balance",), ("pipeline",), ("binding",))
ROOM_OF = {room: i for i, rooms in enumerate(ROOMS) for room in rooms}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "runtime" else None


def test_runtime_rooms_import_downward() -> None:
    rooms = {_room(m) for m in _modules()} - {None}
    assert rooms <= set(ROOM_OF), f"add {sorted(rooms - set(ROOM_OF))} to ROOMS (and docs/architecture.md)"
    wrong = []
    for name, path in _modules().items():
        src = _room(name)
        if src is None:
            continue
        for target in _imports(name, path):
            dst = _room(target)
            if target == "hp_rewrite.runtime" or (dst is not None and dst != src and ROOM_OF[dst] >= ROOM_OF[src]):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "runtime imports that run up or across its rooms:\n" + "\n".join(sorted(wrong))


def test_runtime_face_is_what_generated_code_calls() -> None:
    """hp_rewrite.runtime exports exactly the ``hp.<name>`` calls of the archetypes and the goldens (every
    other name is imported from the room that defines it), in a short __init__.py."""
    import re

    import hp_rewrite.runtime as face

    root = PACKAGE.parent
    sources = [*sorted((root / "archetypes").glob("*.py")), *sorted((root / "tests" / "golden").glob("*.golden"))]
    called = {m for path in sources for m in re.findall(r"\bhp\.([A-Za-z_]\w*)\(", path.read_text())}
    assert called and set(face.__all__) == called, (sorted(set(face.__all__) - called), sorted(called - set(face.__all__)))
    public = {n for n in vars(face) if not n.startswith("_") and not isinstance(getattr(face, n), type(face))}
    assert public == called, sorted(public - called)
    assert len(face.__all__) <= 15 and len((PACKAGE / "runtime" / "__init__.py").read_text().splitlines()) <= 40


def test_importing_the_runtime_leaves_the_compiler_unloaded() -> None:
    """torch._dynamo costs every CLI call 1.4 s at import; the runtime reaches it only when compiling."""
    import subprocess
    import sys

    probe = "import sys, hp_rewrite.runtime, hp_rewrite.cli; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_public_api_resolves() -> None:
    """Every name of hp_rewrite's lazy map is found where the map says (a moved module breaks it loudly)."""
    import importlib

    import hp_rewrite

    for name, module in hp_rewrite._LAZY.items():
        assert hasattr(importlib.import_module(module), name), f"hp_rewrite.{name}: {module} has no {name}"


#: hp_rewrite.hf by topic, bottom to top (shrink.py, above them all, uses configs and logs)
HF_TOPICS = ("logs", "config", "checkpoints", "models", "shrink")


def test_hf_topics_import_downward() -> None:
    modules = {n: p for n, p in _modules().items() if n.startswith("hp_rewrite.hf.")}
    assert {n.rpartition(".")[2] for n in modules} == set(HF_TOPICS), "add the new hf module to HF_TOPICS"
    wrong = [f"{name} -> {target}" for name, path in modules.items() for target in _imports(name, path)
             if target.startswith("hp_rewrite.hf") and (target == "hp_rewrite.hf" or HF_TOPICS.index(
                 target.rpartition(".")[2]) >= HF_TOPICS.index(name.rpartition(".")[2]))]
    assert not wrong, "hf imports that run up or across its topics:\n" + "\n".join(sorted(wrong))


def test_no_public_function_is_defined_twice() -> None:
    """One definition per public name: two functions of one name in two layers (``layer_index`` once took the
    first number of a path in one and the last in the other) are one name meaning two things. The CLI's
    ``register`` is the per-command convention cli/__init__.py calls."""
    where: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and node.name != "register":
                where.setdefault(node.name, []).append(name)
    twice = {n: m for n, m in where.items() if len(m) > 1}
    assert not twice, twice


#: what hp-rewrite leaves on a model's modules, and the one module that reads and writes each
MODULE_STATE = {"hp_rewrite.runtime.installed": {"hp_ep", "hp_original_forward", "hp_last_stats", "hp_router_losses",
                                                 "hp_forward_without_router_losses"},
                "hp_rewrite.loading.record": {"hp_rewrite"}}


def test_module_state_has_one_reader() -> None:
    """A holder's or a model's hp_* attributes are touched in one module each (as ``.name`` or as a string):
    one lookup rule (own attributes, never a wrapper's forwarding), decided once."""
    owner = {attr: module for module, attrs in MODULE_STATE.items() for attr in attrs}
    stale = {"hp_expert_parallel", "hp_layout", "hp_router", "hp_routing_load", "hp_fsdp_sharded"}
    wrong = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            attr = node.attr if isinstance(node, ast.Attribute) else \
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            if attr in stale or (attr in owner and owner[attr] != name and isinstance(node, ast.Attribute)):
                wrong.append(f"{name}:{node.lineno}: {attr}")
            elif attr in owner and owner[attr] != name and attr != "hp_rewrite":
                wrong.append(f"{name}:{node.lineno}: {attr!r}")
    assert not wrong, "module state touched outside its reader:\n" + "\n".join(wrong)
