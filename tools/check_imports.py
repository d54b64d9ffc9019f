"""Every hp_rewrite import in hp_rewrite/, tests/, tools/ and examples/ resolves, function-local ones
included (those inside test worlds run only in spawned processes, so collection does not see them):

    python tools/check_imports.py           # prints each import that fails; exit 1 if any

After moving modules (tools/move_modules.py) this finds what the move missed in a few seconds.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(path: Path):
    """(line, module, names) of each hp_rewrite import in ``path``, relative ones resolved."""
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("hp_rewrite"):
                yield node.lineno, module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("hp_rewrite"):
                    yield node.lineno, alias.name, []


def _is_submodule(package: str, name: str) -> bool:
    try:
        return importlib.util.find_spec(f"{package}.{name}") is not None
    except ModuleNotFoundError:  # ``package`` is a module, not a package
        return False


def main() -> int:
    bad = []
    for top in ("hp_rewrite", "tests", "tools", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for line, module, names in _targets(path):
                where = f"{path.relative_to(ROOT)}:{line}"
                try:
                    loaded = importlib.import_module(module)
                except Exception as e:  # noqa: BLE001 - report every kind of failure
                    bad.append(f"{where}: import {module}: {type(e).__name__}: {e}")
                    continue
                for name in names:
                    if name != "*" and not hasattr(loaded, name) and not _is_submodule(module, name):
                        bad.append(f"{where}: {module} has no {name}")
    print("\n".join(bad) or "every hp_rewrite import resolves")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
