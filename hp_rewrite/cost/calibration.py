"""Measure this machine for the time model: matmul FLOP/s and an alpha-beta fit of all_to_all_single.

Runs on 2 local gloo ranks (``hp_rewrite.launch.run_world``, one thread per rank, like ``apply
--nproc``). Each rank times an fp32 matmul (FLOP/s) and ``all_to_all_single`` of several sizes,
split evenly between the two ranks, so half of each rank's buffer crosses to the peer (the remote
bytes of one message); the median of the repetitions is fitted with least squares to
``time = alpha + remote_bytes / beta``. The result is a :class:`Hardware` preset (JSON).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

from .hardware import Hardware

DEFAULT_SIZES = tuple(2**p for p in range(10, 25, 2))  # 1 KiB .. 16 MiB per rank


@dataclass(frozen=True)
class Calibration:
    hardware: Hardware
    flops_per_s: float
    points: tuple[tuple[float, float], ...]  # (remote bytes, median seconds)


def measure_rank(rank: int, world: int, payload: dict) -> dict:
    """Run on every rank of a gloo world: returns matmul FLOP/s and median all-to-all times."""
    import torch
    import torch.distributed as dist

    n, reps = payload["matmul_n"], payload["reps"]
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    flops = 2 * n**3 * reps / (time.perf_counter() - t)
    points = []
    for size in payload["sizes"]:
        x = torch.zeros(size // 4)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            dist.all_to_all_single(out, x)
            times.append(time.perf_counter() - t)
        points.append((x.numel() * 4 * (world - 1) / world, statistics.median(times)))
    return {"flops_per_s": flops, "points": points}


def fit_alpha_beta(points) -> tuple[float, float]:
    """Fit ``t = alpha + x / beta`` minimising the *relative* error (weights ``1 / t^2``), so the
    small messages that fix alpha count as much as the large ones that fix beta. alpha >= 0."""
    w = [1.0 / (y * y) if y > 0 else 0.0 for _, y in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    sy = sum(wi * y for wi, (_, y) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, points, strict=True))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det else 0.0
    slope = max(slope, 1e-15)
    alpha = (sy - slope * sx) / sw if sw else 0.0
    if alpha < 0:  # refit through the origin
        alpha, slope = 0.0, max(sxy / sxx if sxx else 1e-15, 1e-15)
    return alpha, 1.0 / slope


def _memory_bytes() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2  # two ranks share the host
    except (ValueError, OSError, AttributeError):
        return 8e9


def calibrate(sizes=DEFAULT_SIZES, reps: int = 7, matmul_n: int = 512, timeout: float = 300.0) -> Calibration:
    import torch

    from ..launch import run_world

    ranks = run_world(
        2,
        "hp_rewrite.cost.calibration:measure_rank",
        {"sizes": list(sizes), "reps": reps, "matmul_n": matmul_n},
        timeout=timeout,
    )
    flops = min(r["flops_per_s"] for r in ranks)
    points = tuple(
        (p0[0], max(p0[1], p1[1])) for p0, p1 in zip(ranks[0]["points"], ranks[1]["points"], strict=True)
    )
    alpha, beta = fit_alpha_beta(points)
    host = platform.node() or "this host"
    source = (
        f"measured by hp-rewrite cost --calibrate on {host} ({os.cpu_count()} CPUs), torch {torch.__version__}, "
        f"gloo, 2 ranks x 1 thread, {time.strftime('%Y-%m-%d')}: fp32 {matmul_n}^3 matmul; "
        f"all_to_all_single {min(sizes)}..{max(sizes)} bytes per rank, median of {reps}, relative least-squares fit"
    )
    hw = Hardware(
        name="cpu-gloo-measured",
        flops_per_s=flops,
        efficiency=1.0,
        memory_bytes=_memory_bytes(),
        alpha_s=alpha,
        beta_Bps=beta,
        devices_per_node=os.cpu_count() or 2,
        alpha_inter_s=alpha,
        beta_inter_Bps=beta,
        sources=(source,),
    )
    return Calibration(hw, flops, points)
