"""Specialise an archetype template into the forward of one matched class, with libcst.

A template is an ordinary Python module (``archetypes/*.py``, or a user extension's module) with a
``forward`` function and a frozen dataclass declaring its parameters: the typed contract of the
template. Each field is an upper-case placeholder of the forward, of one of two kinds:

* an *attribute* (declared with :func:`attribute`): ``self.NAME`` becomes the block's real attribute
  name (``self.ROUTER`` -> ``self.gate``); ``None`` means the block has no such child, and the
  branches that use it must be resolved away;
* a *constant* (any other field): the bare ``NAME`` becomes a literal (``TOP_K`` -> ``8``).

Then every ``if`` whose test is made of literals only is resolved, keeping just the branch taken, so
the generated forward contains only the code paths the matched block has. The contract is checked
both ways: a placeholder the forward uses but the dataclass does not declare is an error, and so is
an attribute placeholder left in the generated code without a value.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import types
from typing import Any

import libcst as cst

_ALLOWED_TEST_NODES = (ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Constant, ast.Eq, ast.NotEq,
                       ast.And, ast.Or, ast.Not, ast.In, ast.NotIn, ast.Tuple)
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
_KIND = "hp_rewrite_placeholder"


class TemplateError(ValueError):
    """A template and its parameters dataclass disagree (the archetype contract is broken)."""


def attribute(default: Any = dataclasses.MISSING) -> Any:
    """Declare an attribute placeholder in a template's parameters dataclass (``self.NAME``)."""
    return dataclasses.field(default=default, metadata={_KIND: "attribute"})


def is_attribute(f: dataclasses.Field) -> bool:
    return f.metadata.get(_KIND) == "attribute"


def split_params(params: object) -> tuple[dict[str, str], dict[str, object]]:
    """(attribute renames, constants) of a parameters dataclass instance; ``None`` attributes are left out."""
    if not (dataclasses.is_dataclass(params) and not isinstance(params, type)):
        raise TemplateError(f"template parameters must be a dataclass instance, got {type(params).__name__}")
    names, constants = {}, {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if not _PLACEHOLDER.match(f.name):
            raise TemplateError(f"{type(params).__name__}.{f.name}: placeholders are upper-case names")
        if is_attribute(f):
            if value is not None:
                if not isinstance(value, str) or not all(part.isidentifier() for part in value.split(".")):
                    raise TemplateError(f"{type(params).__name__}.{f.name}: an attribute name (or a dotted path "
                                        f"of them), got {value!r}")
                names[f.name] = value
        else:
            constants[f.name] = value
    return names, constants


def literal(value: object) -> cst.BaseExpression:
    """A libcst expression for a constant (floats that are not finite become ``float("inf")``)."""
    if isinstance(value, float) and value != value:
        raise ValueError("NaN constants cannot be generated")
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return cst.parse_expression(f'float("{"-" if value < 0 else ""}inf")')
    return cst.parse_expression(repr(value))


def _constant_truth(module: cst.Module, test: cst.BaseExpression) -> bool | None:
    """The value of a test made only of literals, else None."""
    tree = ast.parse(module.code_for_node(test).strip(), mode="eval")
    if not all(isinstance(n, _ALLOWED_TEST_NODES) for n in ast.walk(tree)):
        return None
    return bool(eval(compile(tree, "<test>", "eval"), {"__builtins__": {}}))  # noqa: S307 - literals only


def _self_attr(node: cst.Attribute) -> str | None:
    if isinstance(node.value, cst.Name) and node.value.value == "self":
        return node.attr.value
    return None


class _Placeholders(cst.CSTVisitor):
    """Upper-case ``self.NAME`` attributes and bare ``NAME`` names used in a function."""

    def __init__(self) -> None:
        self.attributes: set[str] = set()
        self.constants: set[str] = set()

    def visit_Attribute(self, node):  # noqa: N802 - libcst visitor API
        name = _self_attr(node)
        if name is not None and _PLACEHOLDER.match(name):
            self.attributes.add(name)
        node.value.visit(self)
        return False  # the attr Name of `x.NAME` is not a bare name

    def visit_Name(self, node):  # noqa: N802
        if _PLACEHOLDER.match(node.value):
            self.constants.add(node.value)


class _Specialise(cst.CSTTransformer):
    def __init__(self, module: cst.Module, names: dict[str, str], constants: dict[str, object]) -> None:
        self.names, self.constants, self.module = names, constants, module
        self._elifs: set[int] = set()

    def leave_Attribute(self, original, updated):  # noqa: N802 - libcst visitor API
        if _self_attr(updated) in self.names:  # self.ROUTER -> self.gate (or self.router.layer: a path)
            return cst.parse_expression(f"self.{self.names[updated.attr.value]}")
        return updated

    def leave_Name(self, original, updated):  # noqa: N802
        if updated.value in self.constants:
            return literal(self.constants[updated.value])
        return updated

    def visit_If(self, node):  # noqa: N802
        if isinstance(node.orelse, cst.If):
            self._elifs.add(id(node.orelse))

    def leave_If(self, original, updated):  # noqa: N802
        if id(original) in self._elifs:
            return updated  # resolved together with the chain it belongs to
        return self._resolve(updated)

    def _resolve(self, node: cst.If):
        truth = _constant_truth(self.module, node.test)
        if truth is None:
            return node
        if truth:
            return cst.FlattenSentinel(node.body.body)
        if isinstance(node.orelse, cst.If):
            return self._resolve(node.orelse)
        if isinstance(node.orelse, cst.Else):
            return cst.FlattenSentinel(node.orelse.body.body)
        return cst.RemovalSentinel.REMOVE


def template_source(template: types.ModuleType) -> str:
    """The source text of a template module (read from its file)."""
    try:
        return inspect.getsource(template)
    except (OSError, TypeError) as e:
        raise TemplateError(f"template {template.__name__}: its source is not available ({e})") from None


def _function(module: cst.Module, template: str, function: str) -> cst.FunctionDef:
    funcs = [n for n in module.body if isinstance(n, cst.FunctionDef) and n.name.value == function]
    if not funcs:
        raise TemplateError(f"template {template} has no function {function}")
    return funcs[0]


def check_contract(template: types.ModuleType, params_type: type, function: str = "forward") -> None:
    """Every placeholder the template's ``function`` uses is declared by ``params_type``, as its kind."""
    if not (dataclasses.is_dataclass(params_type) and params_type.__dataclass_params__.frozen):
        raise TemplateError(f"{getattr(params_type, '__name__', params_type)!r}: parameters must be a frozen dataclass")
    declared = {f.name: is_attribute(f) for f in dataclasses.fields(params_type)}
    found = _Placeholders()
    _function(cst.parse_module(template_source(template)), template.__name__, function).visit(found)
    wrong = sorted(n for n in found.attributes if declared.get(n) is not True)
    wrong += sorted(n for n in found.constants if declared.get(n) is not False)
    if wrong:
        raise TemplateError(
            f"template {template.__name__}.{function} uses placeholders that {params_type.__name__} does not "
            f"declare as such: {', '.join(wrong)} (self.NAME needs a field declared with attribute(); a bare "
            "NAME a plain field)"
        )


def specialize(template: types.ModuleType, params: object, new_name: str, function: str = "forward") -> str:
    """Source of ``function`` from ``template`` specialised with ``params`` and renamed to ``new_name``."""
    check_contract(template, type(params), function)
    names, constants = split_params(params)
    module = cst.parse_module(template_source(template))
    func = _function(module, template.__name__, function)
    func = func.visit(_Specialise(module, names, constants)).with_changes(name=cst.Name(new_name), leading_lines=[])
    left = _Placeholders()
    func.visit(left)
    if left.attributes:
        raise TemplateError(
            f"template {template.__name__}.{function}: self.{', self.'.join(sorted(left.attributes))} left in the "
            f"generated code: give {type(params).__name__} a value for it, or resolve the branches that use it"
        )
    return module.with_changes(body=[func], header=[], footer=[]).code
