"""YAML text -> :class:`Plan`, with errors that point at a line.

The document is composed once with PyYAML's SafeLoader: the node tree gives line numbers, and the
same tree is constructed into plain data (safe tags only, so ``!!python/...`` is refused). Pydantic
errors are then rewritten as ``file:line: dotted.path: what is wrong`` by walking the node tree
along each error's location.
"""

from __future__ import annotations

import difflib
import json
import os
import typing
from collections.abc import Iterator
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from yaml.constructor import ConstructorError

from .schema import Plan, PlanError, Problem

_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file. Raises :class:`PlanError` for anything wrong, I/O included."""
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise PlanError([Problem(source, None, "", "no such plan file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError([Problem(source, None, "", f"cannot read the plan: {exc}")]) from None
    return parse_plan(text, source=source, base_dir=os.path.dirname(source))


def parse_plan(text: str, source: str = "<string>", base_dir: str | os.PathLike[str] | None = None) -> Plan:
    """Validate a plan given as YAML text; ``source`` names it in error messages.

    Relative file paths in the plan (``placement.profile``) are read from ``base_dir`` (default: the
    working directory).
    """
    node, data = _read_yaml(text, source)
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {_kind(data)}"
        why = f"the plan is {what}; it must be a mapping with version: and ep_size:"
        raise PlanError([Problem(source, _line(node) or 1, "", why)])
    data = _with_profile_loads(data, node, source, base_dir)
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        raise PlanError(_explain(exc, node, source)) from None


def _with_profile_loads(data: dict, root: yaml.Node | None, source: str, base_dir) -> dict:
    """Read ``placement.profile`` into ``placement.loads``, so the loads are validated and hashed with the plan."""
    placement = data.get("placement")
    if not isinstance(placement, dict) or not isinstance(placement.get("profile"), str):
        return data  # nothing to read; wrong types are reported by the schema

    def problem(message: str) -> PlanError:
        line = _line(_find(root, ("placement", "profile"), want_key=False))
        return PlanError([Problem(source, line, "placement.profile", message)])

    if "loads" in placement:
        raise problem("give either profile: or loads:, not both")
    path = os.path.join(base_dir or os.curdir, placement["profile"])
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise problem(f"{path}: no such file; `hp-rewrite profile PLAN MODEL_DIR --out DIR` writes DIR/profile.json") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise problem(f"{path}: cannot read it as JSON: {exc}") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list) or not all(
        isinstance(x, dict) and isinstance(x.get("path"), str) and isinstance(x.get("tokens_per_expert"), list)
        for x in layers
    ):
        raise problem(f"{path}: not a routing profile (`hp-rewrite profile` writes layers: [{{path, tokens_per_expert}}])")
    loads = {x["path"]: x["tokens_per_expert"] for x in layers}
    return {**data, "placement": {**placement, "loads": loads}}


def _read_yaml(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """Compose, check keys, then construct (which flattens ``<<`` merges in the tree, hence the order)."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            what = "; ".join(str(s) for s in (exc.context, exc.problem) if s)
            line = _mark_line(exc.problem_mark or exc.context_mark)
            raise PlanError([Problem(source, line, "", f"invalid YAML: {what}")]) from None
        except yaml.YAMLError as exc:
            raise PlanError([Problem(source, None, "", f"invalid YAML: {exc}")]) from None
        problems = _key_problems(node, source)
        if problems:
            raise PlanError(problems)
        try:
            return node, (loader.construct_document(node) if node is not None else None)
        except ConstructorError as exc:
            raise PlanError([_constructor_problem(exc, node, source)]) from None
        except Exception as exc:  # PyYAML raises bare ValueError etc. for bad explicitly tagged scalars
            raise PlanError([Problem(source, None, "", f"invalid YAML value: {exc!r}")]) from None
    finally:
        loader.dispose()


def _constructor_problem(exc: ConstructorError, root: yaml.Node | None, source: str) -> Problem:
    mark, problem = exc.problem_mark, str(exc.problem)
    if "could not determine a constructor" not in problem:
        return Problem(source, _mark_line(mark), "", f"invalid YAML: {problem}")
    # A tag outside the safe set (e.g. !!python/object): name the field that carries it.
    path = next((p for p, n in _walk(root) if mark is not None and _starts_at(n, mark)), "")
    tag = problem.split("tag ")[-1].replace("tag:yaml.org,2002:", "!!")
    what = f"YAML tag {tag} is not allowed: plans are read with safe YAML only (code is imported only via extensions:)"
    return Problem(source, _mark_line(mark), path, what)


def _mark_line(mark: yaml.Mark | None) -> int | None:
    return mark.line + 1 if mark is not None else None


def _line(node: yaml.Node | None) -> int | None:
    return node.start_mark.line + 1 if node is not None else None


def _starts_at(node: yaml.Node, mark: yaml.Mark) -> bool:
    return (node.start_mark.line, node.start_mark.column) == (mark.line, mark.column)


def _walk(root: yaml.Node | None) -> Iterator[tuple[str, yaml.Node]]:
    """(dotted path, node) for every node, each visited once (aliases can make the tree a DAG or a cycle)."""
    stack, seen = [("", root)] if root is not None else [], set()
    while stack:
        path, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield path, node
        if isinstance(node, yaml.MappingNode):
            for key, value in reversed(node.value):
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
                stack.append((f"{path}.{name}" if path else name, value))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(node.value))))


def _key_problems(root: yaml.Node | None, source: str) -> list[Problem]:
    """Non-string and duplicate keys, which PyYAML would otherwise accept silently (last one wins)."""
    problems: list[Problem] = []
    for path, node in _walk(root):
        if not isinstance(node, yaml.MappingNode):
            continue
        seen: dict[str, int | None] = {}
        for key, _ in node.value:
            if key.tag == _MERGE_TAG:
                continue
            if not (isinstance(key, yaml.ScalarNode) and key.tag == _STR_TAG):
                shown = key.value if isinstance(key, yaml.ScalarNode) else "a collection"
                problems.append(Problem(source, _line(key), path, f"keys must be plain strings, got {shown}"))
                continue
            sub = f"{path}.{key.value}" if path else key.value
            if key.value in seen:
                where = f"duplicate key (first at line {seen[key.value]})"
                problems.append(Problem(source, _line(key), sub, where))
            seen[key.value] = _line(key)
    return sorted(problems, key=lambda p: (p.line or 0, p.path))


def _find(node: yaml.Node | None, loc: tuple[Any, ...], want_key: bool) -> yaml.Node | None:
    """The node at ``loc`` (the key node of the last step if ``want_key``), else the deepest found."""
    for i, step in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, yaml.MappingNode) and isinstance(step, str):
            match = [(k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == step]
            if not match:
                return node
            key, value = match[-1]
            node = key if (last and want_key) else value
        elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
            node = node.value[step]
        else:
            return node
    return node


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model whose fields live at ``loc`` (nested sections only; lists end the walk)."""
    model: type[BaseModel] = Plan
    for step in loc:
        field = model.model_fields.get(step) if isinstance(step, str) else None
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return None
        model = field.annotation
    return model


def _choices(loc: tuple[Any, ...]) -> list[str]:
    model = _model_at(loc[:-1])
    field = model.model_fields.get(loc[-1]) if model is not None else None
    if field is None or typing.get_origin(field.annotation) is not typing.Literal:
        return []
    return [str(c) for c in typing.get_args(field.annotation)]


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, (int, float)):
        return str(value)
    return f"a {_kind(value)}"


def _kind(value: Any) -> str:
    return {dict: "mapping", list: "list", str: "string"}.get(type(value), type(value).__name__)


_TYPES = {
    "int_type": "an integer",
    "bool_type": "true or false",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "model_type": "a mapping",
    "dict_type": "a mapping",
}


def _message(err: dict[str, Any], loc: tuple[Any, ...]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    got = _show(err.get("input"))
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        allowed = sorted(model.model_fields) if model is not None else []
        text = f"unknown key {loc[-1]!r}; allowed keys here: {', '.join(allowed)}"
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        return text + (f" (did you mean {close[0]!r}?)" if close else "")
    if kind == "missing":
        return "required key is missing"
    if kind == "literal_error":
        choices = ", ".join(_choices(loc)) or ctx.get("expected", "")
        return f"{got} is not a valid choice; choose one of: {choices}"
    if kind in _TYPES:
        extra = " (or the string auto)" if kind == "model_type" and loc == ("archetype",) else ""
        return f"must be {_TYPES[kind]}{extra}, got {got}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']:g}, got {got}"
    if kind == "greater_than":
        return f"must be > {ctx['gt']:g}, got {got}"
    if kind == "finite_number":
        return f"must be a finite number, got {got}"
    if kind == "too_short":
        return "must not be empty"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    return f"{err['msg']}, got {got}"


def _explain(exc: ValidationError, root: yaml.Node | None, source: str) -> list[Problem]:
    """One :class:`Problem` per pydantic error, located by walking the YAML tree along its ``loc``."""
    problems = []
    for err in exc.errors():
        loc, kind = tuple(err["loc"]), err["type"]
        node = _find(root, loc[:-1] if kind == "missing" else loc, want_key=kind == "extra_forbidden")
        problems.append(Problem(source, _line(node), _dotted(loc), _message(err, loc)))
    problems.sort(key=lambda p: (p.line or 0, p.path))
    return problems
