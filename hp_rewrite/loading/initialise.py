"""Tensors the checkpoint lacks, drawn on an expert-parallel rank exactly as the unmodified model draws them.

Plain transformers initialises what the checkpoint lacks (``missing_keys``, and the ``mismatched_keys``
that ``ignore_mismatched_sizes=True`` re-initialises) with the model's ``_init_weights``: a walk over the
modules, children first, each tensor drawn at its full shape from its device's default generator. A rank
holds only its experts, so drawing them there would give values from smaller tensors, and under one
seed the same experts on every rank, silently.

:func:`initialise_missing` walks the modules in transformers' order and calls the model's own
``_initialize_weights`` on each, with two differences:

* a tensor to draw of which this rank holds a part (its experts' rows of a 3-D or flat expert tensor,
  FSDP2's shard of a DTensor, or both) is handed to torch's init function as the full tensor the
  unmodified model has; this rank's part is copied out and the full tensor freed before the next one.
  The transient memory is one parameter at its full size, and only for a tensor the checkpoint lacks;
* experts held as modules that live on other ranks (absent here) are drawn at their place in the walk
  on a copy of a local expert, dropped right after (one expert at a time): the random stream moves on
  exactly as in the unmodified model, so every tensor drawn after them is the same too.

Every draw goes through ``transformers.initialization``'s functions (which torch's ``nn.init`` become
during the walk, as in transformers). An ``_init_weights`` that draws an expert tensor otherwise
(``.data.normal_()``, a slice of it, one draw split over several tensors) cannot be followed: it is
refused by name, never drawn silently.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..hf import initialization, pretrained_model_class
from ..runtime.errors import ExpertParallelError
from .checkpoint_files import ExpertSlice

__all__ = ["initialise_missing"]


@dataclass(frozen=True)
class _FullDraw:
    """A parameter of which this rank holds a part: its name, the unmodified model's shape, this rank's
    expert rows of it (None: all), then FSDP2's shard of those when it is a DTensor."""

    name: str
    full_shape: tuple[int, ...]
    rows: list[tuple[int, int]] | None

    def place(self, full: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy this rank's part of ``full`` into ``tensor``."""
        if not isinstance(tensor, DTensor):
            at = 0
            for a, b in self.rows or [(0, full.shape[0])]:
                tensor[at : at + b - a].copy_(full[a:b])
                at += b - a
            return
        local = full if self.rows is None else torch.cat([full[a:b] for a, b in self.rows])
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        if any(shape):
            tensor.to_local().copy_(local[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))])


@dataclass
class _Draws:
    """The expert tensors to draw at full size, and what the walk saw of them."""

    views: dict[int, _FullDraw]
    storages: dict[int, str]  # data_ptr of each one's storage -> its name
    drawn: set[str] = field(default_factory=set)
    refused: dict[str, str] = field(default_factory=dict)  # name -> how it was drawn
    expected: torch.Tensor | None = None  # the generator's state after the last init function (while watched)
    outside: bool = False  # a random draw happened outside the init functions (while watched)
    held_modules: dict[int, str] = field(default_factory=dict)  # id of a held expert module's tensor -> container
    asked: set[str] = field(default_factory=set)  # containers whose absent experts were looked up by key
    touched_from_above: set[str] = field(default_factory=set)  # containers whose experts a parent initialised
    at: str = ""  # the path of the module being initialised

    def wrap(self, original):
        def init_function(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self._check_outside(tensor.device)
            container = self.held_modules.get(id(tensor))
            if container is not None and not self.at.startswith(f"{container}."):
                self.touched_from_above.add(container)  # the block initialises its experts itself
            draw = self.views.get(id(tensor))
            if draw is None:
                owner = self.storages.get(_storage(tensor))
                if owner is not None:
                    self.refused[owner] = f"an init function on a part of it ({tuple(tensor.shape)})"
                out = original(tensor, *args, **kwargs)
            else:
                full = torch.empty(draw.full_shape, dtype=tensor.dtype, device=tensor.device)
                original(full, *args, **kwargs)
                draw.place(full, tensor)
                del full
                self.drawn.add(draw.name)
                out = tensor
            if self.expected is not None:
                self.expected = _rng_state(tensor.device)
            return out

        return init_function

    def _check_outside(self, device: torch.device) -> None:
        if self.expected is not None and not _same(self.expected, _rng_state(device)):
            self.outside = True

    def initialise(self, module: nn.Module, path: str, fn, custom: bool) -> None:
        """``fn(module)`` (transformers' ``_initialize_weights``), watched where the module owns a
        tensor to draw: a random draw outside the init functions means its ``_init_weights`` draws
        that tensor some other way."""
        self.at = path
        own = [self.views[id(p)] for p in module._parameters.values() if p is not None and id(p) in self.views]
        if not own:
            fn(module, custom)
            return
        device = next(p for p in module._parameters.values() if p is not None).device
        self.expected, self.outside = _rng_state(device), False
        try:
            fn(module, custom)
            self._check_outside(device)
        finally:
            outside, self.expected = self.outside, None
        for draw in own:
            if draw.name not in self.drawn and outside:
                self.refused.setdefault(draw.name, "a random draw outside torch.nn.init / transformers.initialization")

    def check(self, model: nn.Module, ep_size: int, versions: dict[int, tuple[torch.Tensor, int]]) -> None:
        """Refuse what could not be followed; ``versions``: each tensor to draw and its version before the
        walk (written after that, not by a full draw here: some other way, e.g. a copy of a draw)."""
        for key, (t, version) in versions.items():
            name = self.views[key].name
            if name not in self.drawn and t._version != version:
                self.refused.setdefault(name, "a write other than an init function on the whole tensor")
        if not self.refused:
            return
        name, how = next(iter(sorted(self.refused.items())))
        raise ExpertParallelError(
            f"{name} is not in the checkpoint, and {type(model).__name__}._init_weights draws it with {how}: at "
            f"ep_size {ep_size} this rank cannot draw its experts' rows as the unmodified model draws the whole "
            "tensor. Load the model at ep_size 1 (the missing tensors drawn there), save_pretrained it, and load "
            "that checkpoint expert-parallel; or initialise the tensor through transformers.initialization "
            "(init.normal_(module.weight, ...)) on the whole parameter"
            + (f" ({len(self.refused) - 1} more tensor(s) alike)" if len(self.refused) > 1 else "")
        )


def _storage(t: torch.Tensor) -> int | None:
    try:
        return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _rng_state(device: torch.device) -> torch.Tensor | None:
    """The default generator's state on ``device`` (None where the backend does not say)."""
    if device.type == "cpu":
        return torch.random.get_rng_state()
    get = getattr(getattr(torch, device.type, None), "get_rng_state", None)
    return get(device) if get is not None else None


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None or b is None or torch.equal(a, b)


@contextmanager
def _intercepting(functions: dict, draws: _Draws) -> Iterator[None]:
    """transformers' ``TORCH_INIT_FUNCTIONS`` (what every guarded init function ends in) routed through
    ``draws`` for the length of the walk."""
    saved = dict(functions)
    functions.update({k: draws.wrap(f) for k, f in saved.items()})
    try:
        yield
    finally:
        functions.update(saved)


def _full_draws(model: nn.Module, experts: dict[str, ExpertSlice]) -> _Draws:
    """The parameters transformers' initialisation will draw (not flagged as loaded) of which this rank
    holds a part: its experts of an expert tensor, FSDP2's shard of a DTensor."""
    views, storages = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        sl = experts.get(name)
        partial = sl is not None and sl.count < sl.num_experts
        if p.is_meta or getattr(p, "_is_hf_initialized", False) or not (partial or isinstance(p, DTensor)):
            continue
        full = (sl.full_dim0, *p.shape[1:]) if sl is not None else tuple(p.shape)
        views[id(p)] = _FullDraw(name, full, sl.rows if sl is not None else None)
        if (ptr := _storage(p)) is not None:
            storages[ptr] = name
    return _Draws(views, storages)


@dataclass(frozen=True)
class ForeignExperts:
    """A container of experts held as modules, some of them on other ranks: its path, the keys of all its
    experts in expert order, the keys held here, and the full names the unmodified model would draw among
    the absent ones (``...experts.5.w1.weight``: the checkpoint lacks or mismatches them)."""

    path: str
    keys: tuple[str, ...]
    held: tuple[str, ...]
    to_draw: frozenset[str]

    def stand_in(self, container: nn.Module, key: str) -> nn.Module:
        """A fresh copy of a local expert in place of the absent expert ``key``: its tensors to draw not
        flagged as loaded, so the model's own init draws them (and the random stream moves on) as in the
        unmodified model."""
        stand_in = copy.deepcopy(container._modules[self.held[0]])
        for m in stand_in.modules():
            m.__dict__.pop("_is_hf_initialized", None)
        for n, p in stand_in.named_parameters():
            p._is_hf_initialized = f"{self.path}.{key}.{n}" not in self.to_draw
        return stand_in

    def draws_in(self, container: nn.Module, key: str) -> bool:
        return any(f"{self.path}.{key}.{n}" in self.to_draw for n, _ in container._modules[self.held[0]].named_parameters())


class _WithStandIns(dict):
    """A container's ``_modules`` during the walk: an absent expert looked up by key (an ``_init_weights``
    on the block that initialises ``experts[f"expert_{i}"]`` for every i) is a fresh stand-in."""

    def __init__(self, modules: dict, container: nn.Module, foreign: ForeignExperts, asked: set[str]) -> None:
        super().__init__(modules)
        self.container, self.foreign, self.asked = container, foreign, asked

    def __missing__(self, key):
        if key not in self.foreign.keys:
            raise KeyError(key)
        self.asked.add(self.foreign.path)
        return self.foreign.stand_in(self.container, key)


def _children(module: nn.Module, foreign: ForeignExperts | None) -> Iterator[tuple[str, nn.Module]]:
    """``module``'s children in the order transformers' walk visits them; in a container of experts of
    which some live on other ranks, every expert in expert order, an absent one that holds tensors to
    draw as a stand-in (made when reached, dropped after: one expert at a time)."""
    if foreign is None:
        yield from module.named_children()
        return
    held = set(foreign.held)
    for key in foreign.keys:
        if key in held:
            yield key, module._modules[key]
        elif foreign.draws_in(module, key):  # else all in the checkpoint: the unmodified walk draws nothing
            yield key, foreign.stand_in(module, key)
    expert_keys = set(foreign.keys)
    yield from ((k, m) for k, m in module.named_children() if k not in expert_keys)


def _walk(module: nn.Module, path: str, fn, custom: bool, draws: _Draws, foreign: dict[str, ForeignExperts]) -> None:
    """transformers' ``smart_apply``: children first, a sub-model's own ``_initialize_weights`` below it."""
    pretrained = pretrained_model_class()
    for name, child in _children(module, foreign.get(path)):
        child_fn = child._initialize_weights if isinstance(child, pretrained) else fn
        _walk(child, f"{path}.{name}" if path else name, child_fn, custom, draws, foreign)
    draws.initialise(module, path, fn, custom)


@contextmanager
def _stand_ins_by_key(model: nn.Module, foreign: dict[str, ForeignExperts], asked: set[str]) -> Iterator[None]:
    containers = {path: model.get_submodule(path) for path in foreign}
    saved = {path: c._modules for path, c in containers.items()}
    for path, c in containers.items():
        c._modules = _WithStandIns(c._modules, c, foreign[path], asked)
    try:
        yield
    finally:
        for path, c in containers.items():
            c._modules = saved[path]


def needs_exact_draws(model: nn.Module, experts: dict[str, ExpertSlice], foreign: dict[str, ForeignExperts]) -> bool:
    """Whether transformers' own walk would draw other values than the unmodified model's: experts held as
    modules live on other ranks, or an expert tensor of which this rank holds a part is to be drawn."""
    return bool(foreign) or bool(_full_draws(model, experts).views)


@torch.no_grad()
def initialise_missing(model: nn.Module, experts: dict[str, ExpertSlice], foreign: dict[str, ForeignExperts],
                       ep_size: int) -> None:
    """transformers' ``initialize_weights`` on an expert-parallel model: what the checkpoint lacks drawn as
    the unmodified model draws it (``experts``: the holders' per-expert parameters, by name; ``foreign``:
    the containers of experts held as modules of which some live on other ranks, by path)."""
    init = initialization()
    draws = _full_draws(model, experts)
    params = {id(p): p for p in model.parameters()}
    versions = {key: (params[key], params[key]._version) for key in draws.views}
    held = {id(p): path for path, f in foreign.items() for key in f.held
            for p in model.get_submodule(path)._modules[key].parameters()}
    draws.held_modules = held
    try:
        with init.guard_torch_init_functions(), _intercepting(init.TORCH_INIT_FUNCTIONS, draws), \
                _stand_ins_by_key(model, foreign, draws.asked):
            _walk(model, "", model._initialize_weights, model.is_custom_code(), draws, foreign)
    except (KeyError, IndexError, AttributeError) as e:
        raise ExpertParallelError(
            f"{type(model).__name__}._init_weights reaches an expert another rank holds ({type(e).__name__}: {e}): "
            f"at ep_size {ep_size} the experts held as modules are absent here. Load the model at ep_size 1, "
            "save_pretrained it, and load that checkpoint expert-parallel") from e
    for path in sorted(draws.touched_from_above - draws.asked):
        draws.refused.setdefault(f"{path}.*", "a loop over the experts this rank holds (the others are absent here)")
    draws.check(model, ep_size, versions)
