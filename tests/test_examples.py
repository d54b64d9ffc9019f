"""Every recipe under examples/ runs as written (tests/run_example.py), on a tiny Qwen3-MoE checkpoint on 2
gloo ranks, so the docs that quote them cannot drift from the code: each loads the model first (the load
starts the process group under torchrun), trains a few steps through its engine and saves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hp_rewrite.tiny import make_tiny

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
#: what each example leaves in its output folder (under the run's working directory)
WRITES = {"loop_ddp": "out/loop_ddp/model.safetensors", "trainer": "out/trainer/model.safetensors",
          "sft_lora": "out/sft_lora/adapter_model.safetensors", "grpo_vllm": "out/grpo_vllm/model.safetensors",
          "accelerate_ddp": "out/accelerate_ddp/model.safetensors", "fsdp2_trainer": "out/fsdp2_trainer/model.safetensors",
          "fsdp2_accelerate": "out/fsdp2_accelerate/state", "fsdp2_loop": "out/fsdp2_loop"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "m")


def _run(example: str, tiny_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The example under torchrun in ``cwd``, whose home it is too (its artifact cache, ~/.cache/hp-rewrite,
    this run's alone)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "run_example.py"), str(ROOT / "examples" / f"{example}.py"), str(tiny_dir), *args],
        capture_output=True, text=True, timeout=600, cwd=cwd, env={**os.environ, "HOME": str(cwd)})


def test_every_example_is_tested() -> None:
    assert set(EXAMPLES) == set(WRITES), sorted(set(EXAMPLES) ^ set(WRITES))


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs_as_written(example: str, tiny_dir: Path, tmp_path: Path) -> None:
    plan = ROOT / "plans" / ("grpo-ep2.yaml" if example == "grpo_vllm" else "auto-ep2.yaml")
    run = _run(example, tiny_dir, tmp_path, str(plan))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert (tmp_path / WRITES[example]).exists(), sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert any((tmp_path / ".cache" / "hp-rewrite").iterdir())  # the default artifact cache, under this home
    sharded = "fsdp2" in example  # accelerate took its FSDP path, as on a GPU machine
    assert run.stdout.count(f"example {example}.py rank") == 2, run.stdout[-2000:]
    assert f"FSDP2 {not sharded}" not in run.stdout, run.stdout[-2000:]
    if example == "loop_ddp":  # loaded before any process group existed: the load started it, each rank its half
        for rank in range(2):
            assert f"rank {rank} (gloo): hp-rewrite: 2 MoE block(s) expert-parallel, EP 2 (rank {rank} of its EP " \
                   "group holds 4 of 8 experts per block), TP 1" in run.stdout, run.stdout[-2000:]


def test_plan_the_launched_world_cannot_hold_is_refused_by_name(tiny_dir: Path, tmp_path: Path) -> None:
    """Under torchrun with no process group yet, ep_size 4 on 2 ranks: the load starts the world, then refuses
    the plan by name on every rank (never EP 1 or 2 in its place)."""
    run = _run("loop_ddp", tiny_dir, tmp_path, str(ROOT / "plans" / "auto-ep4.yaml"))
    assert run.returncode != 0 and "step 0" not in run.stdout, run.stdout[-2000:]
    assert run.stderr.count("ep_size=4 does not divide the world size 2") >= 2, run.stderr[-4000:]
