"""The cost model: formulas on hand-computed cases, fallbacks, agreement with what the runtime really
does (FlopCounterMode FLOPs and DispatchStats bytes at EP=1 in-process and EP=2 over gloo), the time
model and ``--suggest`` on constructed cases, and the ``cost`` / ``profile`` commands."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import hp_rewrite.runtime as hp
from hp_rewrite.cli import main
from hp_rewrite.cost import formulas
from hp_rewrite.cost import per_rank as cost_per_rank
from hp_rewrite.cost.calibration import fit_alpha_beta
from hp_rewrite.cost.flopcount import count_flops, grouped_mm_flop
from hp_rewrite.cost.hardware import PRESETS, Hardware, load_hardware
from hp_rewrite.cost.per_rank import Knobs, Parallel, Precision, Workload, estimate, layer_cost
from hp_rewrite.cost.profile import routing_profile
from hp_rewrite.cost.ranking import suggest
from hp_rewrite.cost.routing import Histograms, rank_loads
from hp_rewrite.cost.spec import MLPShape, ModelSpec, MoELayerSpec, model_spec
from hp_rewrite.cost.timing import exchange_time, forward_schedule, layer_time
from hp_rewrite.launch import run_world
from hp_rewrite.plan import parse_plan
from hp_rewrite.rewrite import generate, install
from hp_rewrite.runtime.group.groups import ExpertParallelGroup
from hp_rewrite.runtime.routing.routing_load import layer_index
from hp_rewrite.tiny import build_tiny_model, make_tiny, tiny_config
from tests.cost_cases import BATCH, FAMILIES, SEQ, measure

PLANS = Path(__file__).resolve().parent.parent / "plans"
PLAN = PLANS / "auto-ep2.yaml"
REL = 0.01  # the tolerance; every check below is in fact exact


def cli(*args) -> int:
    return main([str(a) for a in args])


# A gated expert with h=8, I=3: 3 matmuls of 8x3 -> 72 weights, 144 FLOPs per row.
GATED = MLPShape(hidden=8, intermediate=3, matmul_params=72, params=72)


# ---------------------------------------------------------------------------------------------
# formulas, hand-computed


def test_formulas_by_hand() -> None:
    tokens = 4 * 2  # s=4, b=2
    assert formulas.router_flops(tokens, 8, 4) == 2 * 8 * 8 * 4 == 512
    # seed: 2 * n_ffMM * s * b * h * hff * k / t_exp, with n_ffMM=3 -- and no /ep (see the module docstring)
    assert GATED.n_ff == 3 and GATED.flops_per_row == 144
    assert formulas.routed_flops_balanced(tokens, 2, GATED) == 2 * 3 * 8 * 8 * 3 * 2 == 2304
    assert formulas.routed_flops_balanced(tokens, 2, GATED, t_exp=2) == 1152
    assert formulas.routed_flops_imbalanced([24, 8], GATED) == 24 * 144
    shared = MLPShape(8, 5, 120, 120)
    assert formulas.shared_flops(tokens, shared, gate=False) == 2 * 3 * 8 * 8 * 5 == 1920
    assert formulas.shared_flops(tokens, shared, gate=True) == 1920 + 2 * 8 * 8
    assert formulas.combine_flops(tokens, 2, 8) == 2 * 8 * 2 * 8
    assert formulas.shared_flops(tokens, None, gate=False) == 0


def _layer(num_experts=4, top_k=2, shared=None, gate=False) -> MoELayerSpec:
    return MoELayerSpec(
        "model.layers.0.mlp",
        0,
        "Block",
        num_experts,
        top_k,
        8,
        GATED,
        shared,
        gate,
        router_params=num_experts * 8,
        archetype={"level": "block"},
        confirmed="executed",
    )


def test_imbalanced_layer_by_hand() -> None:
    # ep=2, T=8 tokens per rank, k=2: 32 slots in the EP group; experts 0-1 on rank 0, 2-3 on rank 1
    plain = Knobs(dedup=False)
    c = layer_cost(_layer(), Parallel(ep=2), Workload(4, 2), Precision.of(2), histogram=[20, 4, 6, 2], knobs=plain)
    assert c.rank == 0 and c.loads.rows == (24, 8) and c.loads.imbalance == 1.5
    assert c.forward.routed == 24 * 144 and c.backward.routed == 2 * 24 * 144
    assert c.forward.router == 512 and c.forward.combine == 2 * 8 * 2 * 8
    ex = c.exchange  # rows of 8 elements x 2 bytes
    assert (ex.rows_sent, ex.rows_received, ex.bytes_sent, ex.bytes_received) == (16, 24, 256, 384)
    assert ex.remote_bytes_received == 24 / 2 * 16  # half of rank 0's rows come from rank 1
    assert ex.remote_bytes_sent == 16 * (1 - 24 / 32) * 16  # its own slots not to its experts
    assert ex.step_bytes == 2 * (256 + 384) and ex.count_bytes == 8 * 4
    other = layer_cost(
        _layer(), Parallel(ep=2), Workload(4, 2), Precision.of(2), histogram=[20, 4, 6, 2], rank=1, knobs=plain
    )
    assert other.forward.routed == 8 * 144 and other.exchange.rows_received == 8


def test_dedup_layer_by_hand() -> None:
    # as above, with one row per (token, rank): rank 0 holds 3/4 of the slots, rank 1 1/4
    c = layer_cost(_layer(), Parallel(ep=2), Workload(4, 2), Precision.of(2), histogram=[20, 4, 6, 2])
    assert c.forward.routed == 24 * 144 and c.forward.combine == 2 * 24 * 8  # weighted adds on the owner
    # P(token hits rank 0) = 1 - C(1,2)/C(4,2) = 1; rank 1: 1 - C(3,2)/C(4,2) = 1/2
    assert cost_per_rank.hit_probability(0.75, 4, 2) == 1.0 and cost_per_rank.hit_probability(0.25, 4, 2) == 0.5
    ex = c.exchange  # rows of 8 x 2 bytes + k * (4 + 2) side columns of 2 bytes (a weight's and an id's bytes)
    assert ex.estimated and (ex.rows_sent, ex.rows_received) == (8 * 1.5, 2 * 8 * 1.0)
    assert (ex.bytes_sent, ex.bytes_received) == (12 * 40, 16 * 40)
    assert (ex.combine_bytes_sent, ex.combine_bytes_received) == (16 * 16, 12 * 16)
    assert (ex.remote_bytes_sent, ex.remote_bytes_received) == (4 * 40, 8 * 40)
    assert ex.step_bytes == 2 * (12 * 40 + 16 * 16) and ex.count_bytes == 8 * (4 + 2)
    # the time model: the combine moves the same remote rows without the side columns (16 of 40 bytes)
    hw = _hw(1e12, alpha_s=1e-6, beta_Bps=1e9)
    dispatch, combine = exchange_time(8 * 40, 2, hw), exchange_time(8 * 16, 2, hw)
    t = layer_time(c, hw, ep=2, overlap=False)
    assert t.comm == pytest.approx(exchange_time(ex.count_bytes, 2, hw) + 2 * (dispatch + combine))
    f = c.forward
    assert t.backward == pytest.approx((2 * (f.router + f.routed + f.combine) / 1e12) + dispatch + combine)
    # uniform routing, 16 experts, top-4, ep 2: 1 - C(8,4)/C(16,4) = 1 - 70/1820
    assert cost_per_rank.hit_probability(0.5, 16, 4) == pytest.approx(1 - 70 / 1820)
    assert layer_cost(_layer(), Parallel(ep=1), Workload(4, 2)).exchange.rows_sent == 16  # no dedup at ep 1


def test_histogram_is_rescaled_to_the_workload() -> None:
    a = rank_loads([20, 4, 6, 2], 4, 2, tokens=8, top_k=2)
    b = rank_loads([10, 2, 3, 1], 4, 2, tokens=8, top_k=2)  # same shape, half the slots
    assert a == b and a.rows == (24, 8)


@pytest.mark.parametrize(
    ("hist", "ep", "why"),
    [
        (None, 2, "no histogram"),
        ([5, 5, 5], 2, "fewer than the 4 experts"),
        ([20, 4, 6, 2], 3, "not divisible by ep=3"),
        ([0, 0, 0, 0], 2, "no routed slots"),
    ],
)
def test_fallbacks_to_balanced(hist, ep, why) -> None:
    loads = rank_loads(hist, 4, ep, tokens=8, top_k=2)
    assert loads.source == "balanced" and why in loads.reason
    assert loads.rows == tuple([8 * 2.0] * ep)  # every rank receives tokens * top_k rows
    assert loads.imbalance == 1.0


def test_longer_histogram_uses_the_first_entries() -> None:
    assert rank_loads([20, 4, 6, 2, 999], 4, 2, tokens=8, top_k=2).rows == (24, 8)


def test_balanced_equals_uniform_histogram_and_capacity() -> None:
    lay = _layer()
    bal = layer_cost(lay, Parallel(ep=2), Workload(4, 2))
    uni = layer_cost(lay, Parallel(ep=2), Workload(4, 2), histogram=[1, 1, 1, 1])
    assert bal.exchange.rows_sent == 8 * 2 * (1 - 1 / 6)  # dedup: a token misses a rank with p C(2,2)/C(4,2)
    assert bal.forward == uni.forward and bal.exchange == uni.exchange
    # capacity ceil(1.0 * 8 * 2 / 4) = 4 slots per source rank and expert (ep=1): [10,2,3,1] keeps [4,2,3,1]
    capped = layer_cost(
        lay, Parallel(ep=1), Workload(4, 2), histogram=[10, 2, 3, 1], knobs=Knobs(capacity_factor=1.0)
    )
    assert capped.exchange.rows_received == 10 and capped.exchange.rows_sent == 10
    assert (
        layer_cost(lay, Parallel(ep=1), Workload(4, 2), knobs=Knobs(capacity_factor=1.0)).exchange.rows_sent
        == 16
    )


def test_etp_tp_cp() -> None:
    lay = _layer(shared=MLPShape(8, 5, 120, 120))
    base = layer_cost(lay, Parallel(), Workload(4, 2))
    # TP-extended EP: each of the 4 TP ranks dispatches a quarter of the group's tokens to complete
    # experts (only etp divides an expert), splits the shared expert, and routes every token
    tp = layer_cost(lay, Parallel(tp=4), Workload(4, 2))
    assert tp.forward.routed == base.forward.routed / 4 and tp.forward.shared == base.forward.shared / 4
    assert tp.forward.router == base.forward.router and tp.exchange.rows_sent == base.exchange.rows_sent / 4
    assert tp.memory.expert_params == base.memory.expert_params
    assert layer_cost(lay, Parallel(etp=2, tp=4), Workload(4, 2)).forward.routed == base.forward.routed / 8
    # its collectives, in units of the group's [tokens, hidden] x 3/4: forward the routed output gathered
    # and the shared expert's all-reduce (2); under SP the input gathered too; backward one more under SP
    unit = 4 * 2 * lay.hidden * 2 * 3 / 4
    assert (tp.tp_forward_bytes, tp.tp_backward_bytes) == (3 * unit, 3 * unit)
    sp = layer_cost(lay, Parallel(tp=4, sequence_parallel=True), Workload(4, 2))
    assert (sp.tp_forward_bytes, sp.tp_backward_bytes) == (4 * unit, 5 * unit)
    assert base.tp_forward_bytes == base.tp_backward_bytes == 0
    cp = layer_cost(lay, Parallel(cp=2), Workload(4, 2))
    assert cp.forward.total == base.forward.total / 2 and cp.exchange.rows_sent == base.exchange.rows_sent / 2
    # Ulysses: query, key, value and output, each this rank's [tokens / cp, hidden], half of it to the other rank
    assert cp.cp_bytes == 4 * (4 * 2 / 2) * lay.hidden * 2 / 2 and base.cp_bytes == 0
    cp4 = layer_cost(lay, Parallel(cp=4), Workload(4, 2))
    assert cp4.cp_bytes == 4 * (4 * 2 / 4) * lay.hidden * 2 * 3 / 4
    with pytest.raises(ValueError, match="ep=0"):
        Parallel(ep=0)


def test_memory_by_hand() -> None:
    lay = _layer()
    m = layer_cost(lay, Parallel(ep=2), Workload(4, 2), Precision.of(2)).memory
    assert (
        m.expert_params == 2 * 72 * 2
        and m.expert_grads == 2 * 72 * 2
        and m.expert_optimizer == 2 * 72 * (8 + 4)
    )
    assert m.replicated_params == 32 * 2  # the router
    # saved: input T*h, received rows*(h + 3I), k outputs per token, fp32 router scores
    assert m.activations == (8 * 8 + 16 * (8 + 9) + 8 * 2 * 8) * 2 + 8 * 4 * 4


def test_grouped_mm_formula_matches_the_eager_loop() -> None:
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(2, 8, 4, requires_grad=True)
    offs = torch.tensor([4, 10], dtype=torch.int32)
    g = torch.randn(10, 4)

    def grouped():
        (torch.nn.functional.grouped_mm(x, w, offs=offs) * g).sum().backward()

    def eager():
        (torch.cat([x[:4] @ w[0], x[4:] @ w[1]]) * g).sum().backward()

    assert count_flops(grouped) == count_flops(eager) == 3 * 2 * 10 * 8 * 4
    assert grouped_mm_flop((8, 10), (10, 4), out_shape=(2, 8, 4)) == 2 * 8 * 4 * 10


def test_layer_index() -> None:
    assert layer_index("model.layers.3.mlp") == 3 and layer_index("model.language_model.layers.12.moe") == 12
    assert layer_index("mlp") is None and layer_index("mlp", 4) == 4
    # nested paths: the outermost layer list's index, as the routing statistics and the cost model both name it
    assert layer_index("model.layers.3.mlp.moe_layers.1.experts") == 3
    assert layer_index("model.language_model.model.layers.5.block_sparse_moe.experts") == 5
    assert layer_index("model.vision_tower.encoder.layers.2.mlp") == 2


# ---------------------------------------------------------------------------------------------
# against the runtime: FlopCounterMode and DispatchStats


def _spec(model_type: str, ep: int) -> ModelSpec:
    model = build_tiny_model(tiny_config(model_type), seed=0)
    return model_spec(model, model.config, parse_plan(f"version: 1\nep_size: {ep}\n"))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.fixture(scope="module")
def specs() -> dict[str, ModelSpec]:
    return {mt: _spec(mt, 2) for mt in FAMILIES}


def test_specs_read_from_weight_shapes(specs) -> None:
    q3, q2, ds = specs["qwen3_moe"], specs["qwen2_moe"], specs["deepseek_v3"]
    assert [lay.layer for lay in q3.layers] == [0, 1] and q3.layers[0].shared is None
    lay = q2.layers[0]
    assert (lay.hidden, lay.routed.intermediate, lay.routed.n_ff, lay.top_k) == (64, 32, 3, 2)
    assert lay.shared.intermediate == 48 and lay.shared.n_ff == 3 and lay.shared_gate
    assert lay.archetype["shared"] == "gated" and lay.confirmed == "executed"
    assert [lay.layer for lay in ds.layers] == [1]  # layer 0 is a dense MLP (first_k_dense_replace)
    assert ds.layers[0].shared.intermediate == 32 and not ds.layers[0].shared_gate
    assert ds.other_params > 0 and ds.dtype_bytes == 4


@pytest.mark.parametrize("compute", ["grouped", "eager"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_ep1_flops_and_bytes_match_the_runtime(model_type, compute, specs, tmp_path) -> None:
    measured = measure(model_type, str(tmp_path), compute=compute)
    spec = specs[model_type]
    assert [m["path"] for m in measured] == [lay.path for lay in spec.layers]
    for lay, m in zip(spec.layers, measured, strict=True):
        pred = layer_cost(lay, Parallel(ep=1), Workload(SEQ, BATCH), Precision.of(4))
        assert m["flops"] > 0 and _rel(pred.step_flops, m["flops"]) <= REL, (
            lay.path,
            pred.step_flops,
            m["flops"],
        )
        ex = pred.exchange
        assert (
            (ex.rows_sent, ex.rows_received) == (m["rows_sent"], m["rows_received"]) == (SEQ * BATCH * 2,) * 2
        )
        assert (ex.bytes_sent, ex.bytes_received) == (m["bytes_sent"], m["bytes_received"])


@pytest.fixture(scope="module")
def ep2_world(tmp_path_factory) -> list[dict]:
    payload = {
        "out_dir": str(tmp_path_factory.mktemp("cost_ep2")),
        "families": list(FAMILIES),
        "computes": ["grouped", "eager"],
    }
    return run_world(2, "tests.cost_cases:run_cost_world", payload, timeout=300)


@pytest.mark.parametrize("compute", ["grouped", "eager"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_ep2_flops_and_bytes_match_each_gloo_rank(model_type, compute, specs, ep2_world) -> None:
    spec = specs[model_type]
    for rank, results in enumerate(ep2_world):
        measured = results[f"{model_type}/{compute}"]
        for lay, m in zip(spec.layers, measured, strict=True):
            hist = m["tokens_per_expert"]  # global: summed over the EP group
            assert sum(hist) == 2 * SEQ * BATCH * lay.top_k
            pred = layer_cost(
                lay, Parallel(ep=2), Workload(SEQ, BATCH), Precision.of(4), Knobs(dedup=False), hist, rank
            )
            assert _rel(pred.step_flops, m["flops"]) <= REL, (rank, lay.path, pred.step_flops, m["flops"])
            ex = pred.exchange
            assert (ex.rows_sent, ex.rows_received) == (m["rows_sent"], m["rows_received"])
            assert (ex.bytes_sent, ex.bytes_received) == (m["bytes_sent"], m["bytes_received"])
    # the two ranks' measurements use one and the same global histogram
    assert (
        ep2_world[0][f"{model_type}/{compute}"][0]["tokens_per_expert"]
        == ep2_world[1][f"{model_type}/{compute}"][0]["tokens_per_expert"]
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_ep2_dedup_moves_fewer_rows_and_the_same_expert_flops(model_type, specs, ep2_world) -> None:
    """The dedup exchange on each gloo rank: the same expert FLOPs as the cost model (its weighted adds are
    elementwise, which FlopCounterMode does not count), fewer rows than the plain exchange, and bytes
    that follow from the rows (hidden row + k * (4 + 2) side columns, one per byte of a weight and an id)."""
    spec = specs[model_type]
    for rank, results in enumerate(ep2_world):
        for lay, m, plain in zip(spec.layers, results[f"{model_type}/dedup"], results[f"{model_type}/grouped"],
                                 strict=True):
            pred = layer_cost(lay, Parallel(ep=2), Workload(SEQ, BATCH), Precision.of(4),
                              histogram=m["tokens_per_expert"], rank=rank)
            matmul = pred.step_flops - pred.forward.combine - pred.backward.combine
            assert _rel(matmul, m["flops"]) <= REL, (rank, lay.path, matmul, m["flops"])
            assert m["rows_sent"] < plain["rows_sent"] and m["rows_received"] <= plain["rows_received"]
            row = lay.hidden * 4 + lay.top_k * (4 + 2) * 4
            assert (m["bytes_sent"], m["bytes_received"]) == (m["rows_sent"] * row, m["rows_received"] * row)


def test_dedup_rows_estimate_matches_uniform_routing(ep2_world) -> None:
    """Uniform routing (4 of 16 experts, 4096 tokens per rank): the estimate is exact in expectation."""
    lay = _layer(num_experts=16, top_k=4)
    for rank, results in enumerate(ep2_world):
        ex = layer_cost(lay, Parallel(ep=2), Workload(4096, 1), rank=rank).exchange
        m = results["uniform"]
        assert _rel(ex.rows_sent, m["rows_sent"]) <= 0.02 and _rel(ex.rows_received, m["rows_received"]) <= 0.02, (
            ex, m)
        assert m["rows_sent"] < 4096 * 4 * 0.5  # against one row per slot


def test_seed_balanced_formula_divides_by_ep_once_too_often(specs, ep2_world) -> None:
    """Mean rows an EP=2 rank received = T*k (our balanced), not the seed's T*k/ep."""
    lay = specs["qwen3_moe"].layers[0]
    received = [r["qwen3_moe/grouped"][0]["rows_received"] for r in ep2_world]
    tokens = SEQ * BATCH
    assert sum(received) / 2 == tokens * lay.top_k
    ours = formulas.routed_flops_balanced(tokens, lay.top_k, lay.routed)
    seed = 2 * lay.routed.n_ff * tokens * lay.hidden * lay.routed.intermediate * lay.top_k / 2
    assert ours == 2 * seed == sum(received) / 2 * lay.routed.flops_per_row


def test_profile_counts_equal_the_runtime_histogram(tmp_path) -> None:
    """The unmodified model's routing (what profile records) is what the rewritten runtime dispatches."""
    plan = parse_plan("version: 1\nep_size: 1\n")
    ref = build_tiny_model(tiny_config("qwen2_moe"), seed=0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    prof = routing_profile(ref, [ids], plan)
    model = build_tiny_model(tiny_config("qwen2_moe"), seed=0)
    _, art = generate(model, plan, model.config, tmp_path)
    install(model, art, plan, ExpertParallelGroup.single())
    seen, original = [], hp.dispatch
    hp.dispatch = lambda *a, **k: seen.append(original(*a, **k)) or seen[-1]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        hp.dispatch = original
    assert [lay.tokens_per_expert for lay in prof.layers] == [
        tuple(s.stats.tokens_per_expert.tolist()) for s in seen
    ]
    assert prof.num_tokens == 16 and prof.top_k == 2


# ---------------------------------------------------------------------------------------------
# time model and --suggest on constructed cases

SYN_LAYER = MoELayerSpec(
    "layers.0.mlp",
    0,
    "Block",
    8,
    2,
    1024,
    MLPShape(1024, 512, 3 * 1024 * 512, 3 * 1024 * 512),
    None,
    False,
    8 * 1024,
    {"level": "block"},
    "structural",
)
SYN = ModelSpec(
    "synthetic",
    4,
    tuple(replace(SYN_LAYER, path=f"layers.{i}.mlp", layer=i) for i in range(4)),
    total_params=4 * 8 * 3 * 1024 * 512,
    dtype_bytes=2,
)
WORK = Workload(512, 2)
FAST_NET = dict(alpha_s=0.0, beta_Bps=1e15, alpha_inter_s=0.0, beta_inter_Bps=1e15)


def _hw(capacity: float, **kw) -> Hardware:
    base = dict(
        name="test",
        flops_per_s=1e12,
        efficiency=1.0,
        memory_bytes=capacity,
        alpha_s=1e-6,
        beta_Bps=1e10,
        devices_per_node=8,
        alpha_inter_s=1e-6,
        beta_inter_Bps=1e10,
    )
    return Hardware(**{**base, **kw})


def _mem(ep: int, hist=None) -> float:
    return estimate(SYN, Parallel(ep=ep), WORK, histograms=hist).memory


def test_exchange_time_and_schedule_by_hand() -> None:
    hw = _hw(1e12, alpha_s=1e-6, beta_Bps=1e9, devices_per_node=2, alpha_inter_s=1e-5, beta_inter_Bps=1e8)
    assert exchange_time(1e6, 1, hw) == 0
    assert exchange_time(1e6, 2, hw) == pytest.approx(1e-6 + 1e6 / 1e9)
    # ep=4 over nodes of 2: 1 peer in the node, 2 outside; a third of the bytes to each
    assert exchange_time(3e6, 4, hw) == pytest.approx(1e-6 + 2e-5 + 1e6 / 1e9 + 2e6 / 1e8)
    mesh = replace(PRESETS["ascend910b-hccs"])
    assert exchange_time(1e9, 2, mesh) == pytest.approx(mesh.alpha_s + 1e9 / mesh.link_Bps)  # one link only
    # the shared expert hides under the dispatch; without overlap everything adds up
    t = forward_schedule(
        1,
        0,
        shared=2,
        experts=4,
        combine_mm=0,
        dispatch=3,
        combine=3,
        chunks=1,
        overlap=True,
        shared_overlaps=True,
    )
    assert t == 1 + 3 + 4 + 3
    assert forward_schedule(1, 0, 2, 4, 0, 3, 3, 1, overlap=False, shared_overlaps=True) == 1 + 2 + 3 + 4 + 3
    # two chunks: chunk 1's dispatch and chunk 0's combine overlap the expert GEMMs
    # (dispatch 2, 2 | experts 2, 2 | combine 2, 2): 8 instead of 12 unchunked
    assert forward_schedule(0, 0, 0, 4, 0, 4, 4, 2, overlap=True, shared_overlaps=False) == 8


def test_suggest_memory_bound_only_large_ep_fits() -> None:
    hw = _hw((_mem(4) + _mem(8)) / 2)
    cands = suggest(SYN, 8, WORK, hw)
    assert [c.ep for c in cands if c.feasible] == [8]
    assert cands[0].ep == 8 and all("needs" in c.reason for c in cands[1:])


def test_suggest_skew_bound_prefers_the_rank_grouping_that_spreads_hot_experts() -> None:
    hot = Histograms(default=(8, 1, 1, 1, 1, 1, 1, 1))
    hw = _hw((_mem(1, hot) + _mem(2, hot)) / 2, **FAST_NET)  # ep=1 does not fit; the network is free
    cands = suggest(SYN, 8, WORK, hw, histograms=hot)
    assert [c.ep for c in cands if c.feasible] == [2, 4, 8]
    assert [round(c.cost.max_imbalance, 3) for c in cands[:3]] == [
        round(2 * 11 / 15, 3),
        round(4 * 9 / 15, 3),
        round(8 * 8 / 15, 3),
    ]
    # balanced routing: the same three cost the same -> the ranking above is the skew's doing
    flat = [c.time.total for c in suggest(SYN, 8, WORK, hw) if c.feasible]
    assert max(flat) == pytest.approx(min(flat), rel=1e-6)


def test_suggest_comm_bound_small_ep_wins() -> None:
    hw = _hw(1.0, flops_per_s=1e16, devices_per_node=2, beta_Bps=1e11, beta_inter_Bps=1e9, alpha_inter_s=1e-4)
    hw = replace(hw, memory_bytes=(_mem(1) + _mem(2)) / 2)
    cands = suggest(SYN, 8, WORK, hw)
    assert [c.ep for c in cands] == [2, 4, 8, 1] and not cands[-1].feasible
    assert cands[2].bound == "comm" and cands[0].time.total < cands[1].time.total < cands[2].time.total


def test_suggest_ranks_tp_degrees_with_their_collectives() -> None:
    """A TP group shares one micro-batch: each rank routes 1/tp of it, so its activations shrink and a
    layout that does not fit at tp 1 fits at tp 2; the ranking is by the world's tokens per second, and
    a TP layout pays its collectives on the critical path."""
    def mem(ep, tp):
        return estimate(SYN, Parallel(ep=ep, tp=tp), WORK).memory

    hw = _hw((mem(8, 1) + mem(8, 2)) / 2, alpha_s=1e-6, beta_Bps=1e9)
    cands = suggest(SYN, 8, WORK, hw, tp_sizes=(1, 2, 4))
    assert {(c.ep, c.tp) for c in cands} == {(e, t) for e in (1, 2, 4, 8) for t in (1, 2, 4)}
    feasible = [c for c in cands if c.feasible]
    assert feasible and all(c.tp >= 2 for c in feasible) and all(c.tp == 1 for c in cands if not c.feasible
                                                                   and c.ep == 8)
    rates = [c.tokens_per_s for c in feasible]
    assert rates == sorted(rates, reverse=True)
    c = feasible[0]
    assert c.tokens_per_s == pytest.approx(8 // c.tp * WORK.seq_len * WORK.micro_batch / c.step_s)
    from hp_rewrite.cost.timing import tp_collective_time

    tp_s = sum(tp_collective_time(lay.tp_forward_bytes, c.tp, hw) + tp_collective_time(lay.tp_backward_bytes, c.tp, hw)
               for lay in c.cost.layers)
    assert 0 < tp_s <= c.time.comm  # its collectives are in the step


def test_suggest_ranks_context_degrees_with_their_exchanges() -> None:
    """A context group shares one micro-batch: each rank holds 1/cp of its tokens, so its activations
    shrink and a layout that does not fit at cp 1 fits at cp 2; tokens per second count a group's batch
    once, and Ulysses' all-to-alls are on the critical path; with tp too, each rank exchanges its heads / tp."""
    from hp_rewrite.cost.timing import tp_collective_time

    def mem(ep, cp):
        return estimate(SYN, Parallel(ep=ep, cp=cp), WORK).memory

    hw = _hw((mem(8, 1) + mem(8, 2)) / 2, alpha_s=1e-6, beta_Bps=1e9)
    cands = suggest(SYN, 8, WORK, hw, tp_sizes=(1, 2), cp_sizes=(1, 2))
    assert {(c.ep, c.tp, c.cp) for c in cands} == {(e, t, p) for e in (1, 2, 4, 8) for t in (1, 2) for p in (1, 2)}
    assert any(c.feasible and c.cp == 2 and c.ep == 8 for c in cands)
    assert not any(c.feasible for c in cands if (c.ep, c.tp, c.cp) == (8, 1, 1))
    c = next(c for c in cands if c.cp == 2 and c.feasible)
    assert c.tokens_per_s == pytest.approx(8 // 2 * WORK.seq_len * WORK.micro_batch / c.step_s)
    ulysses = sum(2 * tp_collective_time(lay.cp_bytes, 2, hw) for lay in c.cost.layers)
    assert 0 < ulysses <= c.time.comm
    both = next(c for c in cands if (c.ep, c.tp, c.cp) == (8, 2, 2))
    alone = next(c for c in cands if (c.ep, c.tp, c.cp) == (8, 1, 2))
    assert both.cost.layers[0].cp_bytes == pytest.approx(alone.cost.layers[0].cp_bytes / 2)


def test_data_parallel_states_and_traffic_by_hand() -> None:
    """Replicated: every non-expert weight and this EP rank's experts on each rank, all-reduced;
    fully_shard: everything / world, all-gathered twice and reduce-scattered once."""
    from hp_rewrite.cost.sharding import data_parallel_cost

    spec = replace(SYN, total_params=SYN.total_params + 10_000_000)  # 10 M outside the MoE layers
    cost = estimate(spec, Parallel(ep=2), WORK)
    hw = _hw(1e12, alpha_s=0.0, beta_Bps=1e9, devices_per_node=8)
    prec = cost.precision
    experts_local = 4 * 4 * 3 * 1024 * 512  # 4 layers, 4 of 8 experts, 3 projections
    other = spec.other_params + sum(lay.router_params for lay in spec.layers)  # routers are replicated too
    rep = data_parallel_cost(cost, 8, "replicate", hw)
    assert rep.state_bytes == pytest.approx((experts_local + other) * prec.state_bytes)
    assert rep.comm_bytes == pytest.approx(2 * prec.grad * (experts_local * 3 / 4 + other * 7 / 8))
    fs = data_parallel_cost(cost, 8, "fully_shard", hw)
    assert fs.state_bytes == pytest.approx((experts_local / 4 + other / 8) * prec.state_bytes)
    assert fs.state_bytes == pytest.approx((4 * 8 * 3 * 1024 * 512 + other) / 8 * prec.state_bytes)  # total / world
    assert fs.comm_bytes == pytest.approx((2 * prec.param + prec.grad) * (experts_local * 3 / 4 + other * 7 / 8))
    assert fs.comm_s == pytest.approx(fs.comm_bytes / 1e9)
    with pytest.raises(ValueError, match="multiple of ep"):
        data_parallel_cost(cost, 3, "fully_shard", hw)


def test_suggest_with_sharded_non_expert_weights_fits_where_replicas_do_not() -> None:
    spec = replace(SYN, total_params=SYN.total_params + 100_000_000)
    hw = _hw(1.0, **FAST_NET)
    fits = suggest(spec, 8, WORK, hw, non_expert="fully_shard")
    hw = replace(hw, memory_bytes=max(c.memory_bytes for c in fits) * 1.01)
    assert all(c.feasible for c in suggest(spec, 8, WORK, hw, non_expert="fully_shard"))
    assert not any(c.feasible for c in suggest(spec, 8, WORK, hw, non_expert="replicate"))
    assert all(c.data_parallel.mode == "fully_shard" for c in fits)


def test_cli_non_expert_needs_suggest(tmp_path, capsys) -> None:
    model = make_tiny("qwen3_moe", tmp_path / "m")
    plan = Path(__file__).parent.parent / "plans" / "auto-ep2.yaml"
    assert main(["cost", str(plan), str(model), "--seq-len", "8", "--micro-batch", "1", "--non-expert",
                 "fully_shard"]) != 0
    assert "--suggest" in capsys.readouterr().out
    assert main(["cost", str(plan), str(model), "--seq-len", "8", "--micro-batch", "1", "--world-size", "4",
                 "--suggest", "--non-expert", "fully_shard", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {c["non_expert"] for c in doc["suggest"]} == {"fully_shard"} and doc["suggest"][0]["dp_comm_bytes"] > 0


QWEN3_30B = Path(__file__).parent / "configs" / "qwen3_30b_a3b"  # the Hub's config.json, no weights
GRPO_PLAN = Path(__file__).parent.parent / "plans" / "grpo-qwen3-30b-a3b.yaml"


def _colocated(capsys, *extra: str) -> dict:
    argv = ["cost", str(GRPO_PLAN), str(QWEN3_30B), "--seq-len", "1280", "--micro-batch", "8", "--world-size", "8",
            "--colocated-vllm", "0.3", "--json", *extra]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)["colocated_rl"]
    return {**{line["name"]: line["bytes"] for line in doc["lines"]}, "total": doc["total_bytes"],
            "capacity": doc["capacity_bytes"]}


def test_colocated_rl_memory_line_by_line(capsys) -> None:
    """RL with vLLM colocated (docs/training.md's GRPO recipe): Qwen3-30B-A3B at EP 8 on 8 GPUs, each line
    against arithmetic by hand: LoRA r 16 fits an 80 GB H100 beside vLLM's 30%, full fine-tuning under FSDP2
    (16 bytes a parameter) does not, and fits a 141 GB H200."""
    hidden, inter, experts, layers, vocab, tokens = 2048, 768, 128, 48, 151936, 8 * 1280
    local = experts // 8 * layers * 3 * hidden * inter  # this rank's routed expert parameters
    lora = _colocated(capsys, "--lora", "16", "--hardware", "h100-nvlink")
    assert lora["routed experts, frozen"] == pytest.approx(local * 2, rel=1e-9)
    adapters = experts // 8 * layers * 16 * ((hidden + 2 * inter) + (inter + hidden))  # gate_up and down
    assert lora["LoRA adapters: weights, gradients, AdamW"] == pytest.approx(adapters * 16, rel=1e-9)
    assert lora["vLLM, colocated"] == pytest.approx(0.3 * 80e9)
    assert lora["logits and their gradient"] == pytest.approx(2 * tokens * vocab * 4)
    assert lora["activations, checkpointed"] > layers * tokens * hidden * 2  # the layers' inputs, plus one layer
    assert lora["total"] == pytest.approx(sum(v for k, v in lora.items() if k not in ("total", "capacity")))
    assert 40e9 < lora["total"] < lora["capacity"] == 80e9
    # docs/training.md's GRPO recipe: vLLM at 0.45 of the H100
    assert _colocated(capsys, "--lora", "16", "--hardware", "h100-nvlink", "--colocated-vllm", "0.45")["total"] == \
        pytest.approx(63.1e9, abs=0.05e9)

    full = _colocated(capsys, "--non-expert", "fully_shard", "--hardware", "h100-nvlink")
    states = full["routed experts"] + full["other weights"] + full["gradients"] + full["fp32 masters and Adam moments"]
    assert full["routed experts"] == pytest.approx(local * 2, rel=1e-9)  # EP 8 on 8 GPUs: no replica to shard over
    assert states == pytest.approx(16 * (full["routed experts"] + full["other weights"]) / 2, rel=1e-9)
    assert full["total"] > full["capacity"]
    assert _colocated(capsys, "--non-expert", "fully_shard", "--hardware", "h200-nvlink")["total"] < 141e9


@pytest.mark.parametrize(("extra", "message"), [
    (["--colocated-vllm", "0.3"], "--world-size"),
    (["--colocated-vllm", "1.5", "--world-size", "8"], "a fraction of the device"),
    (["--colocated-vllm", "0.3", "--world-size", "8", "--lora", "8", "--non-expert", "fully_shard"], "FSDP2"),
])
def test_colocated_rl_memory_user_errors(extra, message, capsys) -> None:
    assert main(["cost", str(GRPO_PLAN), str(QWEN3_30B), "--seq-len", "64", "--micro-batch", "1", *extra]) == 2
    out = capsys.readouterr().out
    assert message in out and "Traceback" not in out, out


# ---------------------------------------------------------------------------------------------
# hardware presets and calibration


def test_presets_and_overrides(tmp_path) -> None:
    assert set(PRESETS) >= {"cpu-gloo", "h100-nvlink", "h200-nvlink", "ascend910b-hccs"}
    for hw in PRESETS.values():
        assert hw.sources and hw.achieved_flops > 0
    f = tmp_path / "hw.json"
    f.write_text(json.dumps({"beta_Bps": 1e9, "memory_bytes": 1e10}))
    hw = load_hardware("h100-nvlink", f)
    assert (
        hw.beta_Bps == 1e9
        and hw.memory_bytes == 1e10
        and hw.flops_per_s == PRESETS["h100-nvlink"].flops_per_s
    )
    f.write_text(PRESETS["cpu-gloo"].to_json())
    assert load_hardware(None, f) == PRESETS["cpu-gloo"]
    f.write_text(json.dumps({"bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        load_hardware("h100-nvlink", f)


def test_alpha_beta_fit_recovers_known_constants() -> None:
    pts = [(x, 5e-5 + x / 2e9) for x in (1e3, 1e4, 1e5, 1e6, 1e7)]
    alpha, beta = fit_alpha_beta(pts)
    assert alpha == pytest.approx(5e-5, rel=1e-6) and beta == pytest.approx(2e9, rel=1e-6)


def test_calibrate_cli_writes_a_usable_preset(tmp_path, capsys) -> None:
    out = tmp_path / "hw.json"
    assert cli("cost", "--calibrate", "--out", out) == 0
    hw = load_hardware(None, out)
    assert hw.flops_per_s > 1e8 and hw.beta_Bps > 1e6 and hw.alpha_s >= 0 and "gloo" in hw.sources[0]


# ---------------------------------------------------------------------------------------------
# the commands


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny("qwen2_moe", tmp_path_factory.mktemp("ckpt") / "qwen2_moe")


@pytest.fixture(scope="module")
def dsv3_dir(tmp_path_factory) -> Path:
    from transformers import AutoConfig

    out = tmp_path_factory.mktemp("dsv3")
    AutoConfig.for_model("deepseek_v3").save_pretrained(out)
    return out


def test_profile_then_cost_with_the_histogram(tiny_dir, tmp_path, capsys) -> None:
    out = tmp_path / "prof"
    assert cli("profile", PLAN, tiny_dir, "--random", "--seq-len", "16", "--batch", "4", "--out", out) == 0
    data = json.loads((out / "profile.json").read_text())
    assert (out / "profile.png").stat().st_size > 1000
    assert data["ep"] == 2 and data["num_tokens"] == 64 and len(data["layers"]) == 2
    for lay in data["layers"]:
        assert sum(lay["tokens_per_expert"]) == 64 * 2 and len(lay["tokens_per_expert"]) == 8
        assert lay["imbalance"] == pytest.approx(max(lay["rank_loads"]) / (64 * 2 / 2))
    assert "imbalance" in capsys.readouterr().out
    # 2 ranks x 2 x 16 tokens: the profile's 64 tokens, so its histogram is used as measured (no rescaling)
    assert (
        cli(
            "cost",
            PLAN,
            tiny_dir,
            "--seq-len",
            "16",
            "--micro-batch",
            "2",
            "--tokens-per-expert",
            out / "profile.json",
            "--hardware",
            "cpu-gloo",
            "--json",
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    layers = doc["cost"]["layers"]
    assert [c["loads"]["source"] for c in layers] == ["histogram", "histogram"]
    # same workload as the profile: the busiest rank's rows are the profile's busiest rank load
    assert [max(c["loads"]["rows"]) for c in layers] == [max(x["rank_loads"]) for x in data["layers"]]
    assert doc["spec"]["confirmed"] == ["executed"] and doc["time"]["total_s"] > 0


def test_profile_drives_a_balanced_placement(tiny_dir, tmp_path, capsys) -> None:
    """profile -> plan placement: balanced -> apply --nproc 2 --verify: the same results, less imbalance."""
    out = tmp_path / "prof"
    assert cli("profile", PLAN, tiny_dir, "--random", "--seq-len", "32", "--batch", "4", "--out", out) == 0
    assert "strategy: balanced" in capsys.readouterr().out
    data = json.loads((out / "profile.json").read_text())
    for lay in data["layers"]:
        assert 1.0 <= lay["balanced_imbalance"] <= lay["imbalance"]
    plan = tmp_path / "balanced.yaml"
    plan.write_text("version: 1\nep_size: 2\nplacement:\n  strategy: balanced\n  profile: prof/profile.json\n")
    report = tmp_path / "report.json"
    assert cli("apply", plan, tiny_dir, "--out", tmp_path / "gen", "--nproc", "2", "--verify", "--report", report) == 0
    result = json.loads(report.read_text())
    verify = result["verify"]
    assert verify["passed"] and verify["logits_max_rel"] <= 1e-5 and verify["grad_max_rel"] <= 1e-5
    placed = [m["experts_by_rank"] for m in result["modules"]]
    assert any(placed), "the profile's routing was balanced already: the placement was not exercised"
    for by_rank in filter(None, placed):
        assert sorted(e for r in by_rank for e in r) == list(range(8)) and all(len(r) == 4 for r in by_rank)

    # a profile of another model (other block paths) stops apply before anything is written
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"layers": [{"path": "model.layers.0.moe", "tokens_per_expert": [1, 2]}]}))
    plan.write_text("version: 1\nep_size: 2\nplacement:\n  strategy: balanced\n  profile: other.json\n")
    capsys.readouterr()
    assert cli("apply", plan, tiny_dir, "--out", tmp_path / "gen2") == 2
    msg = capsys.readouterr().out
    assert "placement" in msg and "model.layers.0.mlp" in msg and "hp-rewrite profile" in msg and "Traceback" not in msg
    assert not (tmp_path / "gen2").exists() or not any((tmp_path / "gen2").iterdir())


def test_profile_from_token_file(tiny_dir, tmp_path, capsys) -> None:
    f = tmp_path / "ids.txt"
    f.write_text("1 2 3 4 5\n6 7 8\n")
    assert cli("profile", PLAN, tiny_dir, "--tokens", f, "--ep", "4", "--out", tmp_path / "p") == 0
    data = json.loads((tmp_path / "p" / "profile.json").read_text())
    assert data["num_tokens"] == 8 and data["ep"] == 4 and len(data["layers"][0]["rank_loads"]) == 4
    f.write_text("[[1, 2, 99999]]")
    f = f.rename(tmp_path / "ids.json")
    assert cli("profile", PLAN, tiny_dir, "--tokens", f) == 2
    assert "outside the vocabulary" in capsys.readouterr().out


def test_cost_table_and_suggest_on_tiny(tiny_dir, capsys) -> None:
    assert (
        cli(
            "cost",
            PLAN,
            tiny_dir,
            "--seq-len",
            "64",
            "--micro-batch",
            "2",
            "--world-size",
            "4",
            "--suggest",
            "--hardware",
            "cpu-gloo",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "qwen2_moe" in out and "EP degrees for world size 4" in out and "routing: balanced" in out


def test_cost_on_deepseek_v3_sized_config_without_weights(dsv3_dir, capsys) -> None:
    assert (
        cli(
            "cost",
            PLAN,
            dsv3_dir,
            "--seq-len",
            "4096",
            "--micro-batch",
            "1",
            "--world-size",
            "64",
            "--suggest",
            "--reserve-gb",
            "20",
            "--json",
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    layers = doc["cost"]["layers"]
    assert len(layers) == 58 and layers[0]["layer"] == 3 and layers[0]["local_experts"] == 128
    assert doc["spec"]["confirmed"] == ["probe"] and "shrunk" in doc["spec"]["notes"][0]
    # 8 routed experts of 3 x 7168 x 2048 per token: 2 * 8 * 3 * 7168 * 2048 FLOPs per token per layer
    assert layers[0]["forward"]["routed"] == 4096 * 2 * 8 * 3 * 7168 * 2048
    assert [s["ep"] for s in doc["suggest"]] and {s["ep"] for s in doc["suggest"]} == {1, 2, 4, 8, 16, 32, 64}
    assert cli("cost", PLAN, dsv3_dir, "--seq-len", "4096", "--micro-batch", "1", "--ep", "64") == 0
    assert "3-60 (x58)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--seq-len"),
        (["--seq-len", "8", "--micro-batch", "1", "--ep", "3"], "does not divide"),
        (["--seq-len", "8", "--micro-batch", "1", "--suggest"], "--world-size"),
        (["--seq-len", "8", "--micro-batch", "1", "--hardware", "tpu"], "unknown hardware"),
    ],
)
def test_cost_user_errors(tiny_dir, extra, message, capsys) -> None:
    assert cli("cost", PLAN, tiny_dir, *extra) == 2
    out = capsys.readouterr().out
    assert message in out and "Traceback" not in out


def test_profile_needs_weights(dsv3_dir, capsys) -> None:
    assert cli("profile", PLAN, dsv3_dir) == 2
    assert "no weights" in capsys.readouterr().out


def test_histograms_from_json(tmp_path) -> None:
    f = tmp_path / "h.json"
    f.write_text(json.dumps([1, 2, 3]))
    assert Histograms.from_json(f).for_layer("any") == (1, 2, 3)
    f.write_text(json.dumps({"a.mlp": [4, 5]}))
    h = Histograms.from_json(f)
    assert h.for_layer("a.mlp") == (4, 5) and h.for_layer("b.mlp") is None


def test_cost_follows_the_plans_balanced_placement(tiny_dir, tmp_path, capsys) -> None:
    """The busiest rank of a balanced plan is the balanced placement's, not the consecutive blocks'."""
    skew = [100, 90, 80, 70, 4, 3, 2, 1]  # consecutive blocks at ep=2: 340 vs 10
    hist = tmp_path / "hist.json"
    hist.write_text(json.dumps(skew))
    loads = {f"model.layers.{i}.mlp": skew for i in range(2)}
    plan = tmp_path / "balanced.yaml"
    plan.write_text(f"version: 1\nep_size: 2\nplacement:\n  strategy: balanced\n  loads: {json.dumps(loads)}\n")
    runs = {}
    for name, p in (("contiguous", PLAN), ("balanced", plan)):
        capsys.readouterr()
        assert cli("cost", p, tiny_dir, "--seq-len", "16", "--micro-batch", "2", "--tokens-per-expert", hist,
                   "--json") == 0
        runs[name] = json.loads(capsys.readouterr().out)["cost"]
    assert runs["balanced"]["knobs"]["placement"] == "balanced"
    assert runs["contiguous"]["knobs"]["placement"] == "contiguous"
    total = sum(runs["contiguous"]["layers"][0]["loads"]["rows"])
    assert runs["contiguous"]["layers"][0]["loads"]["rows"][0] == pytest.approx(total * 340 / 350)
    assert max(runs["balanced"]["layers"][0]["loads"]["rows"]) == pytest.approx(total * 175 / 350)


def test_cost_of_a_big_model_with_a_balanced_plan(dsv3_dir, tmp_path, capsys) -> None:
    """A DeepSeek-V3-sized config: archetypes are still confirmed on the shrunk probe model (the plan's
    loads are for the real expert count), and loads that miss a block are refused, not ignored."""
    skew = [(e % 16) ** 2 for e in range(256)]
    loads = {f"model.layers.{i}.mlp": skew for i in range(3, 61)}
    plan = tmp_path / "balanced.yaml"
    plan.write_text(f"version: 1\nep_size: 8\nplacement:\n  strategy: balanced\n  loads: {json.dumps(loads)}\n")
    capsys.readouterr()
    assert cli("cost", plan, dsv3_dir, "--seq-len", "4096", "--micro-batch", "1", "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["spec"]["confirmed"] == ["probe"] and doc["cost"]["knobs"]["placement"] == "balanced"
    del loads["model.layers.60.mlp"]
    plan.write_text(f"version: 1\nep_size: 8\nplacement:\n  strategy: balanced\n  loads: {json.dumps(loads)}\n")
    assert cli("cost", plan, dsv3_dir, "--seq-len", "4096", "--micro-batch", "1") == 2
    msg = capsys.readouterr().out
    assert "model.layers.60.mlp" in msg and "hp-rewrite profile" in msg and "Traceback" not in msg
