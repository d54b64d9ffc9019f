"""Hardware presets for the time model: matmul FLOP/s, memory, and alpha-beta all-to-all constants.

Every number carries its source next to it. Spec-sheet numbers are peaks; ``efficiency`` (the
fraction of peak MoE GEMMs reach) and the per-message latencies ``alpha`` are assumptions unless
measured, and say so. ``hp-rewrite cost --calibrate`` measures this machine (matmul FLOP/s and
all_to_all_single over 2 gloo ranks) and writes a JSON preset; ``--hardware-file`` overrides any
field of a preset from such a file.

Bandwidths are per rank and per direction (a rank sends and receives at the same time). Switched
fabrics (NVLink + NVSwitch) give each rank ``beta`` whatever the number of peers; a full mesh
(HCCS in an Atlas 800T A2) gives one link of ``link_Bps`` per peer, so a small EP group uses only
a few links: the effective in-node bandwidth is ``min(beta, peers * link_Bps)``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from types import MappingProxyType


@dataclass(frozen=True)
class Hardware:
    name: str
    flops_per_s: float  # peak dense matmul FLOP/s in the training dtype
    efficiency: float  # fraction of the peak the MoE GEMMs reach
    memory_bytes: float  # per device
    alpha_s: float  # per message, inside a node
    beta_Bps: float  # per rank, one direction, inside a node
    devices_per_node: int
    alpha_inter_s: float  # per message, between nodes
    beta_inter_Bps: float  # per rank, one direction, between nodes
    link_Bps: float | None = None  # full mesh: one link per peer (None: switched fabric)
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("flops_per_s", "efficiency", "memory_bytes", "beta_Bps", "beta_inter_Bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {self.name}: {name} must be > 0, got {getattr(self, name)!r}")
        if self.alpha_s < 0 or self.alpha_inter_s < 0 or self.devices_per_node < 1:
            raise ValueError(f"hardware {self.name}: alphas must be >= 0 and devices_per_node >= 1")

    @property
    def achieved_flops(self) -> float:
        return self.flops_per_s * self.efficiency

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def updated(self, data: dict) -> Hardware:
        """A copy with the fields of ``data`` (unknown keys are an error, not silently ignored)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown hardware field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        data = dict(data)
        if "sources" in data:
            data["sources"] = tuple(data["sources"])
        return replace(self, **data)


_NVLINK4 = (
    "NVLink 4 + NVSwitch: 900 GB/s bidirectional per GPU (NVIDIA H100/H200 datasheets) "
    "-> 450 GB/s per direction"
)
_IB_NDR = (
    "between nodes: DGX/HGX H100 and H200 have one 400 Gb/s ConnectX-7 InfiniBand NIC per GPU "
    "(NVIDIA DGX H100/H200 user guide) -> 50 GB/s per direction"
)
_ALPHA_GPU = (
    "alpha 3 us in a node, 6 us between nodes: assumption (order of published NCCL small-message "
    "latencies), not a spec number; calibrate on the target machine"
)
_EFF = "efficiency 0.6: assumption for grouped expert GEMMs (not measured here)"

PRESETS: MappingProxyType[str, Hardware] = MappingProxyType(
    {
        # Measured on the development host, a 2-CPU VM: `hp-rewrite cost --calibrate`, 2 gloo ranks x 1 thread,
        # torch 2.13.0+cpu; three runs gave 36-43 GFLOP/s, alpha 116-248 us, beta 0.8-1.25 GB/s (rounded here).
        "cpu-gloo": Hardware(
            name="cpu-gloo",
            flops_per_s=4.0e10,
            efficiency=1.0,
            memory_bytes=12.6e9,
            alpha_s=2.0e-4,
            beta_Bps=1.0e9,
            devices_per_node=2,
            alpha_inter_s=2.0e-4,
            beta_inter_Bps=1.0e9,
            sources=(
                "measured with hp-rewrite cost --calibrate on the development host (2-CPU VM, 25 GB RAM shared by "
                "2 ranks), torch 2.13.0+cpu, gloo; CPU numbers vary by machine and load: rerun it on yours",
            ),
        ),
        "h100-nvlink": Hardware(
            name="h100-nvlink",
            flops_per_s=989e12,
            efficiency=0.6,
            memory_bytes=80e9,
            alpha_s=3e-6,
            beta_Bps=450e9,
            devices_per_node=8,
            alpha_inter_s=6e-6,
            beta_inter_Bps=50e9,
            sources=(
                "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity -> 989 dense; "
                "80 GB HBM3",
                _NVLINK4,
                _IB_NDR,
                _ALPHA_GPU,
                _EFF,
            ),
        ),
        "h200-nvlink": Hardware(
            name="h200-nvlink",
            flops_per_s=989e12,
            efficiency=0.6,
            memory_bytes=141e9,
            alpha_s=3e-6,
            beta_Bps=450e9,
            devices_per_node=8,
            alpha_inter_s=6e-6,
            beta_inter_Bps=50e9,
            sources=(
                "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense "
                "(same GH100 compute as H100); 141 GB HBM3e",
                _NVLINK4,
                _IB_NDR,
                _ALPHA_GPU,
                _EFF,
            ),
        ),
        "ascend910b-hccs": Hardware(
            name="ascend910b-hccs",
            flops_per_s=320e12,
            efficiency=0.5,
            memory_bytes=64e9,
            alpha_s=5e-6,
            beta_Bps=196e9,
            devices_per_node=8,
            alpha_inter_s=10e-6,
            beta_inter_Bps=25e9,
            link_Bps=28e9,
            sources=(
                "Ascend 910B: ~320 TFLOPS FP16/BF16 and 64 GB HBM2e per NPU as quoted in public summaries of "
                "Huawei figures (SKUs 910B1-B4 differ; check yours)",
                "Atlas 800T A2 technical specifications (Huawei): 8 NPUs in an HCCS full mesh, 392 GB/s per NPU = "
                "7 links x 56 GB/s; read here like NVLink's 900 GB/s, as both directions -> 196 GB/s and 28 GB/s "
                "per link per direction (assumption)",
                "between nodes: 8 x 200GE RoCE per Atlas 800T A2 (one per NPU) -> 25 GB/s per direction",
                "alpha 5 us / 10 us and efficiency 0.5: assumptions, not spec numbers",
            ),
        ),
    }
)


def load_hardware(name: str | None = None, file: Path | None = None) -> Hardware:
    """A preset (default ``h200-nvlink``), with the fields of a JSON ``file`` (e.g. from --calibrate) on top.

    A file alone (``name`` None) must define every field or name a ``"base"`` preset.
    """
    data = json.loads(Path(file).read_text()) if file is not None else {}
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object of hardware fields")
    base_name = name or data.pop("base", None) or ("" if data.get("flops_per_s") else "h200-nvlink")
    data.pop("base", None)
    if base_name and base_name not in PRESETS:
        raise ValueError(f"unknown hardware {base_name!r}; presets: {', '.join(PRESETS)}")
    if not base_name:
        data["sources"] = tuple(data.get("sources", ()))
        return Hardware(**data)
    return PRESETS[base_name].updated(data) if data else PRESETS[base_name]
