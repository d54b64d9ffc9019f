"""Reading an artifact back for ``hp-rewrite inspect``: the generated module or its diff, whole or one forward."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import OutputError, UserError
from .artifacts import DIFF_FILE, MANIFEST_FILE, MODULE_FILE


def find_artifact(directory: Path) -> Path:
    """``directory`` when it is an artifact, else the newest artifact inside it (an ``apply --out``)."""
    if (directory / MANIFEST_FILE).is_file():
        return directory
    found = sorted((p.parent for p in directory.glob(f"*/{MANIFEST_FILE}")), key=lambda p: p.stat().st_mtime)
    if not found:
        raise OutputError(f"{directory}: no generated artifact here; run hp-rewrite apply first")
    return found[-1]


def generated_text(directory: Path, block: str | None = None, diff: bool = False) -> str:
    """The generated module (or, with ``diff``, its unified diff against the original forwards);
    with ``block``, only the part generated for that class."""
    art = find_artifact(directory)
    text = (art / (DIFF_FILE if diff else MODULE_FILE)).read_text()
    if block is None:
        return text
    manifest = json.loads((art / MANIFEST_FILE).read_text())
    names = {q.rsplit(".", 1)[-1]: e["function"] for q, e in manifest["classes"].items()}
    if block not in names:
        raise UserError(f"--block {block}: no generated forward for it; generated classes: {', '.join(sorted(names))}")
    return _section(text, names[block], diff)


def _section(text: str, function: str, diff: bool) -> str:
    if diff:
        parts = text.split("--- a/")
        return "".join("--- a/" + p for p in parts if f":{function}\n" in p)
    keep, out = False, []
    for line in text.splitlines(keepends=True):
        if line.startswith("def "):
            keep = line.startswith(f"def {function}(")
        if keep:
            out.append(line)
    return "".join(out)
