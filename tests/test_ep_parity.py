"""Expert-parallel parity on real gloo processes: 1, 2 and 4 ranks against the unmodified block.

One world per size runs every case (spawning is the slow part); each case is then reported as its
own test. Tolerances: fp32 1e-5 relative to the largest reference value, bf16 3e-2.
"""

from __future__ import annotations

import pytest

from hp_rewrite.launch import run_world

FAMILIES = [
    "qwen3",
    "qwen3_contract",
    "mixtral",
    "qwen2",
    "deepseek_v3",
    "gpt_oss",
    "aria",
    "openai_pf",
    "laguna",
    "nemotron_h",
    "separate",
    "w1w3w2_transposed",
]

NO_DEDUP_CASES = {
    "qwen3-fp32",
    "gpt_oss-fp32",
    "qwen3-bf16",
    "qwen3-sync",
    "forced-top4",
    "deepseek_v3-chunks2-async-equals-sync",
    "capacity-probs",
    "capacity-probs-renorm-chunks2",
    "rank1-sends-nothing-chunks4",
    "placed-interleaved-qwen3",
    "placed-interleaved-capacity-probs",
}


BALANCE = {"balance": "auto", "balance_threshold": 1.0, "balance_min_rows": 1}
BALANCE_CASES = {  # runtime.balance forced on: every family and layout, bf16, chunks, capacity, placement, dedup
    *(f"{f}-fp32" for f in FAMILIES),
    "qwen3-bf16",
    "mixtral-bf16",
    "deepseek_v3-bf16",
    "gpt_oss-bf16",
    "qwen3-autocast",
    "gpt_oss-autocast",
    "skewed",
    "skewed-chunks4",
    "forced-top4",
    "forced-top4-bf16-chunks2",
    "capacity-probs",
    "deepseek_v3-chunks2-async-equals-sync",
    "last-rank-receives-nothing",
    "rank1-sends-nothing",
    "placed-interleaved-qwen3",
    "placed-balanced-deepseek_v3",
    "ep2-of-4-qwen3-skewed",
    "forced-top4-no-dedup",
    "capacity-probs-no-dedup",
    "qwen3-sync-no-dedup",
}

DEFER_CASES = {  # runtime.defer_expert_grads: every weight layout, bf16, chunks, capacity, placement, empty ranks
    "qwen3-fp32",
    "gpt_oss-fp32",
    "separate-fp32",
    "w1w3w2_transposed-fp32",
    "deepseek_v3-fp32",
    "qwen3-bf16",
    "gpt_oss-bf16",
    "deepseek_v3-chunks2-async-equals-sync",
    "capacity-probs",
    "last-rank-receives-nothing",
    "rank1-sends-nothing-chunks4",
    "placed-interleaved-qwen3",
    "placed-balanced-deepseek_v3",
    "forced-top4-no-dedup",
    "ep2-of-4-qwen2",
    "skewed-balanced",
    "gpt_oss-bf16-balanced",
    "hot-expert-balanced",
}


def _cases(world: int) -> list[dict]:
    cases = [{"name": f"{f}-fp32", "family": f} for f in FAMILIES]
    cases += [
        {"name": "qwen3-bf16", "family": "qwen3", "dtype": "bf16"},
        {"name": "mixtral-bf16", "family": "mixtral", "dtype": "bf16"},
        {"name": "deepseek_v3-bf16", "family": "deepseek_v3", "dtype": "bf16"},
        {"name": "gpt_oss-bf16", "family": "gpt_oss", "dtype": "bf16"},
        {"name": "qwen3-autocast", "family": "qwen3", "autocast": True},  # fp32 weights, bf16 autocast
        {"name": "gpt_oss-autocast", "family": "gpt_oss", "autocast": True},
        {"name": "qwen3-eager", "family": "qwen3", "options": {"compute": "eager"}},
        {"name": "gpt_oss-eager", "family": "gpt_oss", "options": {"compute": "eager"}},
        {"name": "qwen3-sync", "family": "qwen3", "options": {"overlap": False}},
        {"name": "qwen2-async-equals-sync", "family": "qwen2", "compare_sync": True},
        {
            "name": "deepseek_v3-chunks2-async-equals-sync",
            "family": "deepseek_v3",
            "options": {"chunks": 2},
            "compare_sync": True,
        },
        {"name": "skewed", "family": "qwen3", "routing": "skewed"},
        # top-1 (one destination per token) and top-4 (up to 4 destinations: the widest dedup partial sum)
        {"name": "forced-top1", "family": "qwen3", "routing": "forced", "top_k": 1},
        {"name": "forced-top4", "family": "qwen3", "routing": "forced", "top_k": 4},
        {"name": "forced-top4-bf16-chunks2", "family": "qwen3", "routing": "forced", "top_k": 4, "dtype": "bf16",
         "options": {"chunks": 2}},
        {"name": "skewed-chunks4", "family": "qwen3", "routing": "skewed", "options": {"chunks": 4}},
        {
            "name": "capacity-probs",
            "family": "qwen3",
            "routing": "skewed",
            "options": {"capacity_factor": 1.0, "drop_policy": "probs"},
        },
        {
            "name": "capacity-position",
            "family": "qwen3",
            "options": {"capacity_factor": 0.75, "drop_policy": "position"},
        },
        {
            # natural routing: with every slot on one rank's experts the renormalised weights are
            # constant and the router gradient is rounding noise, nothing to compare
            "name": "capacity-probs-renorm-chunks2",
            "family": "qwen3",
            "options": {
                "capacity_factor": 0.75,
                "drop_policy": "probs",
                "renormalize_kept": True,
                "chunks": 2,
            },
        },
        {
            "name": "capacity-position-sync-eager",
            "family": "qwen3",
            "options": {
                "capacity_factor": 0.5,
                "drop_policy": "position",
                "overlap": False,
                "compute": "eager",
            },
        },
    ]
    for chunks in (2, 4):
        cases.append(
            {"name": f"deepseek_v3-chunks{chunks}", "family": "deepseek_v3", "options": {"chunks": chunks}}
        )
        cases.append({"name": f"gpt_oss-chunks{chunks}", "family": "gpt_oss", "options": {"chunks": chunks}})
    if world > 1:
        cases += [
            {"name": "last-rank-receives-nothing", "family": "qwen3", "routing": "starve_last"},
            {"name": "rank1-sends-nothing", "family": "qwen3", "tokens": [12, 0, 9, 5]},
            {
                "name": "rank1-sends-nothing-chunks4",
                "family": "qwen2",
                "tokens": [3, 0, 9, 5],
                "options": {"chunks": 4},
            },
        ]
        cases += [  # experts not in consecutive blocks (plan placement: balanced): same results
            {"name": f"placed-{p}-{f}", "family": f, "placement": p}
            for p, f in [("interleaved", "qwen3"), ("interleaved", "qwen3_contract"), ("interleaved", "gpt_oss"),
                         ("balanced", "qwen2"), ("balanced", "separate"), ("balanced", "deepseek_v3")]
        ]
        cases += [
            {"name": "placed-interleaved-deepseek_v3-chunks2-async-equals-sync", "family": "deepseek_v3",
             "placement": "interleaved", "options": {"chunks": 2}, "compare_sync": True},
            {"name": "placed-interleaved-capacity-probs", "family": "qwen3", "placement": "interleaved",
             "routing": "skewed", "options": {"capacity_factor": 1.0, "drop_policy": "probs"}},
            {"name": "placed-balanced-rank1-sends-nothing", "family": "qwen3", "placement": "balanced",
             "tokens": [12, 0, 9, 5]},
        ]
        cases += [  # the plain exchange (one row per routed slot) stays tested next to the default dedup
            {**c, "name": f"{c['name']}-no-dedup", "options": {**c.get("options", {}), "dedup": False}}
            for c in cases
            if c["name"] in NO_DEDUP_CASES
        ]
    if world == 4:
        cases += [  # single-token decode at EP=4: ranks receiving nothing, local experts with no row
            {"name": f"decode-1-token-{f}{'-bf16' if d else ''}", "family": f, "tokens": [1, 1, 1, 1],
             "watch_grouped": True, **({"dtype": "bf16"} if d else {})}
            for f in ("qwen3", "deepseek_v3") for d in (False, True)
        ]
        cases += [  # EP=2 x 2 replicas: expert gradients summed over the replica group
            {"name": "ep2-of-4-qwen2", "family": "qwen2", "ep": 2},
            {"name": "ep2-of-4-qwen3-skewed", "family": "qwen3", "ep": 2, "routing": "skewed"},
            {"name": "ep2-of-4-placed-interleaved-qwen2", "family": "qwen2", "ep": 2, "placement": "interleaved"},
        ]
    if world > 1:  # runtime.balance forced on (any imbalance, any piece): rows must move, results unchanged
        cases += [
            {"name": "hot-expert", "family": "qwen3", "routing": "hot_expert"},
            {"name": "hot-expert-bf16-chunks2", "family": "deepseek_v3", "routing": "hot_expert", "dtype": "bf16",
             "options": {"chunks": 2}},
        ]
        cases += [
            {**c, "name": f"{c['name']}-balanced", "options": {**c.get("options", {}), **BALANCE}}
            for c in cases
            if c["name"] in BALANCE_CASES or c["name"].startswith("hot-expert")
        ]
        cases.append({"name": "skewed-balanced-one-replica", "family": "qwen3", "routing": "skewed",
                      "options": {**BALANCE, "balance_replicas": 1}})
    if world > 1:  # expert weight gradients deferred into the backward's exchange waits
        cases += [
            {**c, "name": f"{c['name']}-defer", "options": {**c.get("options", {}), "defer_expert_grads": True}}
            for c in cases
            if c["name"] in DEFER_CASES
        ]
    return cases


_RESULTS: dict[int, list] = {}


def _world(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_world(world, "tests.ep_cases:run_all", _cases(world))
    return _RESULTS[world]


PARAMS = [(w, c["name"]) for w in (1, 2, 4) for c in _cases(w)]


@pytest.mark.parametrize(("world", "case"), PARAMS, ids=[f"ranks{w}-{c}" for w, c in PARAMS])
def test_ep_matches_unmodified(world: int, case: str) -> None:
    for rank, results in enumerate(_world(world)):
        r = results[case]
        assert r.get("bitwise_sync_equal", True), f"rank {rank}: async path differs from sync path"
        assert r["ok"], (
            f"rank {rank}: {r['worst']} relative error {r['worst_err']:.3g} > {r['tol']:.0e}; all: {r['errors']}"
        )


@pytest.mark.parametrize("world", [2, 4])
def test_groups_take_the_world_timeout_and_are_built_once(world: int) -> None:
    """The EP groups wait as long as the world does (on NCCL a shorter timeout is a watchdog abort of a
    healthy job), the plan's runtime.timeout_s when it sets one; one set of groups per layout."""
    for rank, results in enumerate(_world(world)):
        g = results["groups"]
        assert g["backend"] == "gloo" and g["reused"], (rank, g)
        assert g["ep_timeout"] == g["world_timeout"] == 120 and g["plan_timeout"] == 7, (rank, g)


WIRE = [f"{f}-{d}-chunks{c}" for f in ("deepseek_v3", "mixtral", "qwen3") for d in ("dedup", "per-slot") for c in (1, 2)]


@pytest.mark.parametrize("case", WIRE)
def test_bf16_layer_sends_hidden_dtype_rows_once_each_way(case: str) -> None:
    """A bf16 layer (DeepSeek-V3 and Mixtral route with fp32 weights) makes one count exchange and one
    all-to-all per direction per chunk, forward and backward, every row in bf16 (side values packed in);
    no sum over a token's contributions runs in an order the device picks (CUDA atomics)."""
    chunks = int(case[-1])
    for rank, results in enumerate(_world(2)):
        r = results["wire"][case]
        dtypes = [d for d, _ in r["forward"]]
        assert dtypes == ["int64"] + ["bfloat16"] * 2 * chunks, (rank, r["forward"])
        assert [d for d, _ in r["backward"]] == ["bfloat16"] * 2 * chunks, (rank, r["backward"])
        assert r["unordered_sums"] == [], (rank, r["unordered_sums"])


def test_decode_pads_empty_expert_groups_and_never_calls_grouped_mm_empty() -> None:
    """Single-token decode at EP=4: some rank's local experts get no row (and some ranks none at all);
    those cases ran through the parity check above; here: the runtime padded them, and no grouped_mm
    call saw an empty group."""
    results = _world(4)
    for name in [c["name"] for c in _cases(4) if c.get("watch_grouped")]:
        ranks = [r[name] for r in results]
        assert all(r["grouped_ok"] for r in ranks), [r["grouped_calls"] for r in ranks]
        assert sum(r["padded"] for r in ranks) > 0, name
