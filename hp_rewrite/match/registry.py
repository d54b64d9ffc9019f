"""The archetype registry: built-in archetypes and the ones a plan's ``extensions:`` modules register.

An archetype is a template module (a ``forward`` with upper-case placeholders), the frozen dataclass
declaring those placeholders (its typed contract, see :mod:`hp_rewrite.codegen.specialize`), a
structural predicate on the :class:`~hp_rewrite.match.structure.BlockStructure`, and a function
deriving candidate parameters from the structure and the execution probe. Built-ins and extensions
register the same way, with :func:`register_archetype`::

    from hp_rewrite.match import register_archetype
    from my_team import temperature_template as template

    @register_archetype("temperature_topk", template=template, params=template.Params,
                        predicate=lambda s: s.router_name is not None and hasattr(s.block, "temperature"))
    def derive(s, probe):
        return template.Params(ROUTER=s.router_name, EXPERTS=s.experts_name, TOP_K=s.block.top_k)

The matcher tries the extensions' archetypes first (plan order, then registration order), then the
built-in ones, and execution confirms every candidate the same way (:mod:`hp_rewrite.match.archetype`).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..codegen.artifacts import module_source_hash
from ..codegen.specialize import check_contract
from ..plan import PlanError, Problem
from .structure import BlockStructure

#: ``origin`` of the archetypes hp-rewrite ships.
BUILTIN = "hp_rewrite"
LEVELS = ("block", "experts")


@dataclass
class Probe:
    """What a ``derive`` function may look at besides the structure: the materialised probe copy of the
    block (random weights, its experts already expert-parallel at EP=1), the probe's hidden rows
    ``[T, H]``, the plan's forced choices, whether the model records the router's outputs, and whether
    the block's own forward returns ``(out, router_weights)``."""

    block: nn.Module
    hidden: Any
    forced: dict
    recorded_router: bool
    returns_router_weights: bool


@dataclass(frozen=True)
class ArchetypeSpec:
    """One registered archetype (see the module docstring)."""

    name: str
    template: types.ModuleType
    params: type
    predicate: Callable[[BlockStructure], bool]
    derive: Callable[[BlockStructure, Probe], Any]
    level: str = "block"
    describe: Callable[[Any], tuple[str, str]] | None = None  # params -> (router, shared) labels
    function: str = "forward"
    origin: str = BUILTIN  # the module that registered it

    @property
    def builtin(self) -> bool:
        return self.origin == BUILTIN

    @property
    def label(self) -> str:
        return self.name if self.builtin else f"{self.origin}:{self.name}"

    def candidates(self, s: BlockStructure, probe: Probe) -> list:
        """The parameters ``derive`` proposes, as a list (it may return one instance or an iterable)."""
        found = self.derive(s, probe)
        if found is None:
            return []
        if isinstance(found, self.params):
            return [found]
        found = list(found)
        wrong = [type(p).__name__ for p in found if not isinstance(p, self.params)]
        if wrong:
            raise TypeError(f"archetype {self.label}: derive returned {', '.join(wrong)}, not {self.params.__name__}")
        return found

    def labels(self, params: Any) -> tuple[str, str]:
        """(router, shared) as recorded in the manifest and shown by ``inspect``."""
        return self.describe(params) if self.describe else ("extension", "extension")

    def sources_sha256(self) -> dict[str, str]:
        """sha256 of the registering module's and the template's files: part of the artifact key."""
        names = sorted({self.origin, self.template.__name__} - {BUILTIN})
        return {n: module_source_hash(n) for n in names}


_REGISTRY: dict[str, dict[str, ArchetypeSpec]] = {}  # origin -> name -> spec, in registration order
_loading: list[str] = []  # extension modules being imported by load_extensions (innermost last)


def register_archetype(name: str, *, template: types.ModuleType, params: type,
                       predicate: Callable[[BlockStructure], bool], derive: Callable | None = None,
                       level: str = "block", describe: Callable | None = None, function: str = "forward",
                       origin: str | None = None):
    """Register an archetype. With ``derive`` returns the :class:`ArchetypeSpec`; without, a decorator
    for the derive function (returned unchanged).

    ``derive(structure, probe)`` returns a ``params`` instance, an iterable of them (tried in order,
    the first execution confirms wins) or None. The registering module is the one being loaded from
    the plan's ``extensions:``, else the caller's module. Registering the same name again from the
    same module replaces it (a reloaded module).
    """
    if origin is None:
        origin = _loading[-1] if _loading else sys._getframe(1).f_globals.get("__name__", "__main__")
    if level not in LEVELS or (level == "experts" and origin != BUILTIN):
        raise ValueError(f"archetype {name}: level {level!r}; extensions register block-level archetypes")
    if not isinstance(template, types.ModuleType):
        raise TypeError(f"archetype {name}: template must be a module, got {type(template).__name__}")
    check_contract(template, params, function)

    def register(derive_fn: Callable) -> Callable:
        _REGISTRY.setdefault(origin, {})[name] = ArchetypeSpec(
            name, template, params, predicate, derive_fn, level, describe, function, origin
        )
        return derive_fn

    if derive is not None:
        register(derive)
        return _REGISTRY[origin][name]
    return register


def registered(origin: str = BUILTIN) -> list[ArchetypeSpec]:
    """The archetypes ``origin`` registered, in registration order."""
    return list(_REGISTRY.get(origin, {}).values())


def _extension_error(index: int, message: str) -> PlanError:
    return PlanError([Problem("plan", None, f"extensions[{index}]", message)])


def load_extensions(names: Sequence[str]) -> list[ArchetypeSpec]:
    """Import the plan's ``extensions:`` modules in order; the archetypes they register.

    Raises :class:`~hp_rewrite.plan.PlanError` naming ``extensions[i]`` and the module when one cannot
    be imported or registers no archetype.
    """
    specs: list[ArchetypeSpec] = []
    for i, name in enumerate(names):
        _loading.append(name)
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported with the plan field at fault
            raise _extension_error(i, f"cannot import the extension module {name!r}: {type(e).__name__}: {e}") from e
        finally:
            _loading.pop()
        found = registered(name)
        if not found:
            raise _extension_error(
                i, f"the extension module {name!r} registers no archetype; it must call "
                "hp_rewrite.match.register_archetype(...) when imported (docs/plan-format.md, Extension point)"
            )
        specs.extend(found)
    return specs

