"""Count what would stall the host on a GPU, on CPU: reads of tensor values into Python and tensors built
from Python data.

On CUDA a read (``tolist``, ``item``, ``bool(t)``, ``nonzero``...) waits for every kernel queued on the
stream, and ``torch.tensor(python list)`` on the device is a blocking copy from pageable memory. On CPU
neither costs anything, so tests count the calls instead: :class:`HostTraffic` is a torch function mode
that records each such call with the Python frame that made it. Calls below torch itself are not seen
(a C++ autograd node cannot read to the host; a Python ``autograd.Function`` backward is seen).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

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
