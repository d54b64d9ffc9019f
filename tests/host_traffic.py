"""Count what would stall the host on a GPU, on CPU: reads of tensor values into Python and tensors built
from Python data; and the peak of temporaries a block of code makes (:class:`LiveTemporaries`).

On CUDA a read (``tolist``, ``item``, ``bool(t)``, ``nonzero``...) waits for every kernel queued on the
stream, and ``torch.tensor(python list)`` on the device is a blocking copy from pageable memory. On CPU
neither costs anything, so tests count the calls instead: :class:`HostTraffic` is a torch function mode
that records each such call with the Python frame that made it. Calls below torch itself are not seen
(a C++ autograd node cannot read to the host; a Python ``autograd.Function`` backward is seen).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.unique, torch.unique, torch.masked_select, torch.Tensor.masked_select,
}
UPLOADS = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor, torch.from_numpy}


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and ("torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}" if frame else "?"


def _is_read(func, args, kwargs) -> bool:
    if func in READS:
        return True
    if func is torch.Tensor.__getitem__:  # a boolean mask: the result's size is a device value
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):  # without output_size: a read
        return kwargs.get("output_size") is None and isinstance(args[1] if len(args) > 1 else None, torch.Tensor)
    return False


@dataclass
class HostTraffic(TorchFunctionMode):
    """``with HostTraffic() as t: ...``; then ``t.reads`` and ``t.uploads``: (function, caller) per call.

    ``events``: every read and upload, and each :meth:`mark` in the order they happened."""

    reads: list = field(default_factory=list)
    uploads: list = field(default_factory=list)
    events: list = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in UPLOADS:
            self.uploads.append((getattr(func, "__name__", str(func)), _caller()))
            self.events.append("upload")
        elif _is_read(func, args, kwargs):
            self.reads.append((getattr(func, "__name__", str(func)), _caller()))
            self.events.append("read")
        return func(*args, **kwargs)

    def mark(self, what: str) -> None:
        self.events.append(what)


class LiveTemporaries(TorchDispatchMode):
    """The most bytes of tensors made inside the block that were alive at once (``peak``).

    Every op's outputs that do not share storage with its inputs (a ``cat``, an ``empty``: new memory;
    not an in-place op or a view) are followed until Python drops them, by storage; ``peak`` is the
    largest total seen after any op. What the CPU can say about a GPU's ``max_memory_allocated``."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._live: list[tuple[weakref.ref, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                storage = t.untyped_storage()
                self._live.append((weakref.ref(t), storage.data_ptr(), storage.nbytes()))
        self._live = [entry for entry in self._live if entry[0]() is not None]
        self.peak = max(self.peak, sum({ptr: n for _, ptr, n in self._live}.values()))
        return out
