"""Under sequence parallelism, keep only this rank's chunk of a gathered input for backward.

An attention, MLP or MoE block gathers the sequence on entry; the projections that read the gathered
``[B, S, H]`` would save it whole for their backward, which is what sequence parallelism is meant to
avoid (the whole sequence stays alive on every rank until backward). While such a module runs, a
saved-tensors hook replaces every saved tensor that lives in the gathered storage by this rank's
chunk, and gathers it again when backward needs it (once per module: the projections share it), as
Megatron's sequence-parallel linears do. Under activation checkpointing (or any other saved-tensors
hooks) it steps aside: those already decide what is kept.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..runtime.group import tokens


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class _Gathered:
    """One gathered input: the chunk kept, and the whole rebuilt at most once in backward."""

    def __init__(self, chunk: torch.Tensor, full: torch.Tensor, boundary) -> None:
        self.chunk, self.boundary = chunk.detach(), boundary
        self.storage, self.nbytes = full.untyped_storage().data_ptr(), full.untyped_storage().nbytes()
        self.shape, self._full = full.shape, None

    def owns(self, t: torch.Tensor) -> bool:
        try:
            s = _local(t).untyped_storage()
            return s.data_ptr() == self.storage and s.nbytes() == self.nbytes
        except (RuntimeError, NotImplementedError):  # a tensor without storage of its own (a wrapper subclass)
            return False

    def full(self) -> torch.Tensor:
        if self._full is None:
            with torch.no_grad():
                b = self.boundary
                self._full = tokens.gather(self.chunk, b.group, b.rank, b.size, self.shape[1], 1).contiguous()
        return self._full


def _pack(gathered: list[_Gathered]):
    def pack(t: torch.Tensor):
        for g in gathered:
            if g.owns(t):
                local = _local(t)
                spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
                return g, local.shape, local.stride(), local.storage_offset(), spec
        return t

    return pack


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    g, shape, stride, offset, spec = packed
    view = g.full().as_strided(shape, stride, offset)
    if spec is None:
        return view
    mesh, placements, global_shape, global_stride = spec
    return DTensor.from_local(view, mesh, placements, run_check=False, shape=global_shape, stride=global_stride)


class Regather:
    """Entered by a module's forward pre-hook once it has gathered its input, left by its forward hook."""

    def __init__(self) -> None:
        self._active: list = []

    def enter(self, chunk: torch.Tensor, full: torch.Tensor, boundary) -> None:
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None or not torch.is_grad_enabled():
            self._active.append(None)  # activation checkpointing (or no backward): nothing to do
            return
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack([_Gathered(chunk, full, boundary)]), _unpack)
        hooks.__enter__()
        self._active.append(hooks)

    def leave(self) -> None:
        hooks = self._active.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)
