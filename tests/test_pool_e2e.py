"""tools/pool_e2e.py: the paired ratios of several bench_e2e runs, pooled per variant."""

from __future__ import annotations

import json
from pathlib import Path

from tools.pool_e2e import main, pooled


def _run(path: Path, ratios: dict[str, list[float]]) -> Path:
    results = {name: {"paired_ratio_vs_native_per_iter": xs} for name, xs in ratios.items()}
    results["failed-variant"] = {"median_step_s": 1.0}  # no ratios (e.g. native EP missing): skipped
    path.write_text(json.dumps({"results": results}))
    return path


def test_runs_are_pooled_per_variant(tmp_path: Path, capsys) -> None:
    a = _run(tmp_path / "a.json", {"hp": [0.7, 0.9], "native": [1.0, 1.0]})
    b = _run(tmp_path / "b.json", {"hp": [0.8], "only-in-b": [0.5]})
    assert pooled([a, b]) == {"hp": [0.7, 0.9, 0.8], "native": [1.0, 1.0], "only-in-b": [0.5]}
    main([str(a), str(b)])
    out = capsys.readouterr().out
    assert "pooled over 2 runs" in out
    hp_row = next(line for line in out.splitlines() if "│ hp " in line)
    assert "0.800x" in hp_row and "2/3" in hp_row  # median of 0.7, 0.8, 0.9; two at or under 0.8
