"""Pool several ``tools/bench_e2e.py`` result files: per variant, the per-iteration paired ratios to
native EP of every run together.

One run gives 10 paired ratios; on this shared machine the effective CPU speed drifts within a run
(the CPU time of the same step moves by 30%), so a single run's median moves by several percent.
Pooling the runs gives the median and quartiles over all iterations, and the share of iterations
at or under the target.

    python tools/pool_e2e.py bench-results/bench_e2e_final5.json bench-results/bench_e2e_final6.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table


def pooled(files: list[Path]) -> dict[str, list[float]]:
    """Variant -> paired ratios of every iteration of every file (variants missing from a file are skipped there)."""
    ratios: dict[str, list[float]] = {}
    for f in files:
        for name, r in json.loads(f.read_text())["results"].items():
            if "paired_ratio_vs_native_per_iter" in r:
                ratios.setdefault(name, []).extend(r["paired_ratio_vs_native_per_iter"])
    return ratios


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="bench_e2e.py --out files")
    p.add_argument("--target", type=float, default=0.8, help="ratio to count iterations against")
    a = p.parse_args(argv)
    table = Table(title=f"paired time per token vs native EP, pooled over {len(a.files)} runs")
    for col in ("variant", "iterations", "median", "quartiles", f"iterations <= {a.target}"):
        table.add_column(col, justify="left" if col == "variant" else "right", no_wrap=True)
    for name, xs in pooled(a.files).items():
        q1, _, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0], xs[0], xs[0])
        under = sum(x <= a.target for x in xs)
        table.add_row(name, str(len(xs)), f"{statistics.median(xs):.3f}x", f"{q1:.3f}-{q3:.3f}",
                      f"{under}/{len(xs)}")
    Console(width=110).print(table)


if __name__ == "__main__":
    main()
