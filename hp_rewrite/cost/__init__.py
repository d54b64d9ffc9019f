"""Cost model and routing profile for expert-parallel MoE layers (docs/cost-model.md).

``model_spec`` reads the MoE layers of a (meta) model from its weight shapes; ``estimate`` costs
them per rank (FLOPs, all-to-all bytes, memory) for a parallel setting and a workload, balanced or
skew-aware from a tokens-per-expert histogram; ``step_time`` turns a cost into seconds on a
:class:`Hardware`; ``suggest`` ranks EP degrees; ``routing_profile`` profiles real routing. The
FLOP and byte formulas are checked against FlopCounterMode and the runtime's ``DispatchStats``
(tests/test_cost.py). Importing this package does not import torch until a function needs it.
"""

from __future__ import annotations

_LAZY = {
    "MLPShape": "spec",
    "MoELayerSpec": "spec",
    "ModelSpec": "spec",
    "model_spec": "spec",
    "Parallel": "per_rank",
    "Workload": "per_rank",
    "Precision": "per_rank",
    "Knobs": "per_rank",
    "LayerCost": "per_rank",
    "ModelCost": "per_rank",
    "estimate": "per_rank",
    "layer_cost": "per_rank",
    "Histograms": "routing",
    "RankLoads": "routing",
    "rank_loads": "routing",
    "Hardware": "hardware",
    "PRESETS": "hardware",
    "load_hardware": "hardware",
    "step_time": "timing",
    "layer_time": "timing",
    "exchange_time": "timing",
    "Candidate": "ranking",
    "suggest": "ranking",
    "RoutingProfile": "profile",
    "routing_profile": "profile",
    "write_profile": "profile",
    "calibrate": "calibration",
    "break_even_rows": "balance",
    "BalanceForecast": "balance",
    "forecast": "balance",
    "count_flops": "flopcount",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
