"""tools/device_check.py runs on CPU at its small size (CI has no accelerator): parity passes, the
benchmark rows and the JSON are written, and its EP=2 section runs as two processes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "device_check.py"


def test_device_check_on_cpu(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("device_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "device_check.json"
    assert module.main(["--size", "small", "--iters", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and [c["dtype"] for c in report["parity"]] == ["float32", "bfloat16"]
    if report["device"] == "cpu":
        assert all(c["kernels"][0]["backend"] == "grouped" for c in report["parity"])
    assert set(report["bench"]) == {"hp", "hf-grouped", "dense"}
    assert all(r["median_s"] > 0 for r in report["bench"].values())
    assert report["kernels"], report["kernels"]  # what ran, by name (on CPU: the aten ops)
    kept = report["kept"]  # (d): the kept experts' GEMMs give the decoded values' results, with fewer bytes
    assert set(kept) == {"mxfp4", "fp8", "fp8_gemm"} and all(r["passed"] for r in kept.values()), kept
    assert all(r["weight_bytes"]["kept"] < r["weight_bytes"]["dense"] for r in kept.values()), kept
    ep2 = report["ep2_one_device"]
    assert set(ep2) == {"rank0", "rank1"}
    for cases in ep2.values():
        assert set(cases) == {"qwen3_moe", "deepseek_v3", "decode-1-token", "qwen3_moe-balanced",
                              "qwen3_moe-cp2-ulysses"}
        assert all(c["passed"] for c in cases.values()), cases
        assert all(c["bitwise_repeatable"] for n, c in cases.items() if n != "qwen3_moe-cp2-ulysses"), cases

