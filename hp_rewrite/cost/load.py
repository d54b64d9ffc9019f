"""The checkpoint bytes each rank reads at load, in the format the checkpoint stores (``hp-rewrite cost``).

The expert-parallel loaders read every tensor outside the experts once and 1/EP of the experts, in
the stored format: an MXFP4 expert weight is half a byte a value plus one scale byte per 32 values; a
block-FP8 Linear weight one byte a value plus an fp32 scale per block; everything else its dtype.
Counted from the model's shapes (built on the meta device: parameters and persistent buffers, tied
tensors once), so it needs no weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..loading.quantized import MXFP4_GROUP, QuantFormat, checkpoint_format, fp8_linear_weights, stored_dtype
from ..match.structure import find_experts_holders

__all__ = ["LoadBytes", "load_bytes"]


@dataclass(frozen=True)
class LoadBytes:
    format: str  # "mxfp4" | "fp8" | the dtype of a plain checkpoint
    dequantized_to: str | None  # the parameters' dtype after load (quantised checkpoints only)
    expert_bytes: int  # every expert tensor, as stored
    other_bytes: int  # everything else, as stored
    ep: int

    @property
    def per_rank(self) -> int:
        return self.other_bytes + self.expert_bytes // self.ep

    @property
    def total(self) -> int:
        return self.other_bytes + self.expert_bytes

    def as_dict(self) -> dict:
        return {"format": self.format, "dequantized_to": self.dequantized_to, "expert_bytes": self.expert_bytes,
                "other_bytes": self.other_bytes, "total_bytes": self.total, "per_rank_bytes": self.per_rank,
                "ep": self.ep}


def _stored(p, fmt: QuantFormat | None, quantised: bool, itemsize: int) -> int:
    if fmt is not None and quantised and fmt.method == "mxfp4":
        return p.numel() // 2 + p.numel() // MXFP4_GROUP
    if fmt is not None and quantised and fmt.method == "fp8":
        rows, cols = p.shape[-2:]
        blocks = -(-rows // fmt.block[0]) * -(-cols // fmt.block[1])
        return p.numel() + 4 * blocks * (p.numel() // (rows * cols))
    return p.numel() * itemsize


def load_bytes(model: nn.Module, config, ep: int) -> LoadBytes:
    """What each rank reads at load from ``config``'s checkpoint with ``ep`` ranks per EP group."""
    fmt = checkpoint_format(getattr(config, "quantization_config", None))
    dtype = stored_dtype(config)
    itemsize = {"float32": 4, "float64": 8}.get(dtype, 2)
    holders = [name for name, _ in find_experts_holders(model, any_layout=True)]
    linears = fp8_linear_weights(model)
    expert = other = 0
    seen: set[int] = set()
    for name, p in model.state_dict(keep_vars=True).items():  # persistent buffers too; tied tensors once
        if id(p) in seen:
            continue
        seen.add(id(p))
        in_experts = any(name.startswith(f"{h}.") for h in holders)
        if fmt is not None and fmt.method == "mxfp4":
            quantised = in_experts and p.dim() == 3 and name.rsplit(".", 1)[-1] in ("gate_up_proj", "down_proj")
        else:
            quantised = p.dim() >= 2 and (name in linears or (in_experts and not name.endswith("bias")))
        size = _stored(p, fmt, quantised, itemsize if p.is_floating_point() else p.element_size())
        if in_experts:
            expert += size
        else:
            other += size
    return LoadBytes(fmt.method if fmt else dtype, dtype if fmt else None, expert, other, ep)
