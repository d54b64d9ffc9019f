"""Specialise an archetype template into the forward of one matched class, with libcst.

A template is ordinary Python (``archetypes/*.py``). Upper-case placeholders are of two kinds:

* ``self.NAME`` attributes become the block's real attribute names (``self.ROUTER`` -> ``self.gate``);
* bare ``NAME`` constants become literals (``TOP_K`` -> ``8``).

Then every ``if`` whose test is made of literals only is resolved, keeping just the branch taken, so
the generated forward contains only the code paths the matched block has.
"""

from __future__ import annotations

import ast
from importlib import resources
from pathlib import Path

import libcst as cst

_ALLOWED_TEST_NODES = (ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Constant, ast.Eq, ast.NotEq,
                       ast.And, ast.Or, ast.Not, ast.In, ast.NotIn, ast.Tuple)


def template_path(name: str) -> Path:
    """Path of an archetype template shipped in the package (``hp_rewrite.archetypes``)."""
    return Path(str(resources.files("hp_rewrite.archetypes").joinpath(f"{name}.py")))


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


class _Specialise(cst.CSTTransformer):
    def __init__(self, names: dict[str, str], constants: dict[str, object]) -> None:
        self.names, self.constants = names, constants
        self.module = cst.Module(body=[])
        self._elifs: set[int] = set()

    def leave_Attribute(self, original, updated):  # noqa: N802 - libcst visitor API
        if isinstance(updated.value, cst.Name) and updated.value.value == "self" and updated.attr.value in self.names:
            return updated.with_changes(attr=cst.Name(self.names[updated.attr.value]))
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


def specialize(template: str, function: str, new_name: str, names: dict[str, str],
               constants: dict[str, object]) -> str:
    """Source of ``function`` from template ``template`` specialised and renamed to ``new_name``."""
    source = template_path(template).read_text()
    module = cst.parse_module(source)
    funcs = [n for n in module.body if isinstance(n, cst.FunctionDef) and n.name.value == function]
    if not funcs:
        raise KeyError(f"template {template} has no function {function}")
    transformer = _Specialise(names, constants)
    transformer.module = module
    func = funcs[0].visit(transformer).with_changes(name=cst.Name(new_name), leading_lines=[])
    return module.with_changes(body=[func], header=[], footer=[]).code
