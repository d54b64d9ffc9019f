"""Zero-computation (identity) experts, matched by structure: the up weight holds Z more experts than down.

Ids ``>= E`` give ``w * x`` on the sending rank and are never dispatched. Whole-model parity of LongCat-Flash
(EP=1 and EP=2) is in test_rewrite.py, its checkpoint round trip in test_save.py; here: a synthetic block
at block level (output and every gradient), what is refused and why, and the cost model."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from hp_rewrite.cost.per_rank import Knobs, Parallel, Precision, Workload, layer_cost
from hp_rewrite.cost.spec import MLPShape, MoELayerSpec, model_spec
from hp_rewrite.match.analysis import analyze
from hp_rewrite.match.archetype import compile_function
from hp_rewrite.match.diagnosis import describe
from hp_rewrite.match.structure import find_blocks
from hp_rewrite.plan import DEFAULT_PLAN, parse_plan
from hp_rewrite.runtime.binding.install import install_expert_parallel
from hp_rewrite.runtime.group.groups import ExpertParallelGroup
from hp_rewrite.runtime.options import RuntimeOptions
from hp_rewrite.runtime.pipeline.capacity import apply_capacity
from hp_rewrite.tiny import build_tiny_model, tiny_config
from tests.rewrite_cases import TOL, compare

H, E, Z, I = 16, 4, 2, 8  # noqa: E741 - the usual MoE size names


class _ZeroExperts(nn.Module):
    """No num_experts, no name to go by: gate_up_proj [E+Z], down_proj [E]; ids >= E are identity
    (``identity=False``: they give zero, which is not what the runtime computes)."""

    def __init__(self, identity: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = nn.Parameter(0.3 * torch.randn(E + Z, 2 * I, H, generator=g))
        self.down_proj = nn.Parameter(0.3 * torch.randn(E, H, I, generator=g))
        self.act_fn = nn.SiLU()
        self.identity = identity

    def forward(self, hidden, top_k_index, top_k_weights):
        rows = []
        for t in range(hidden.shape[0]):
            y = torch.zeros_like(hidden[t])
            for k in range(top_k_index.shape[1]):
                e, x = int(top_k_index[t, k]), hidden[t]
                if e >= E:
                    out = x if self.identity else torch.zeros_like(x)
                else:
                    gate, up = (self.gate_up_proj[e] @ x).chunk(2)
                    out = self.down_proj[e] @ (self.act_fn(gate) * up)
                y = y + top_k_weights[t, k] * out
            rows.append(y)
        return torch.stack(rows)


class _Block(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E + Z, bias=False)  # logits over the routed and the zero experts
        self.top_k = 3
        self.experts = experts

    def forward(self, x):
        h = x.reshape(-1, H)
        w, idx = torch.softmax(self.gate(h), -1).topk(self.top_k, -1)
        return self.experts(h, idx, w).reshape(x.shape)


class _Model(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.layers = nn.ModuleList([make() for _ in range(2)])


class _UnequalNotZero(_ZeroExperts):
    """Unequal expert dims the other way round (down holds more): not zero experts, refused."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E + Z, H, I))


def test_block_level_zero_experts_match_output_and_every_gradient() -> None:
    torch.manual_seed(0)
    ref = _Block(_ZeroExperts())
    [match] = describe(_Model(lambda: copy.deepcopy(ref)), None)["groups"]
    assert match["archetype"]["level"] == "block" and match["archetype"]["layout"] == "fused-zero-experts", match
    [s] = find_blocks(_Model(lambda: copy.deepcopy(ref)).layers[:1])
    assert (s.num_experts, s.zero_experts, s.router_name) == (E, Z, "gate")

    model = copy.deepcopy(ref)
    arch = analyze(nn.ModuleList([model]), DEFAULT_PLAN).matched[0].archetype
    install_expert_parallel(model.experts, num_experts=E, ep=ExpertParallelGroup.single(), options=RuntimeOptions())
    model.forward = types.MethodType(compile_function(arch.source("f"), "f"), model)
    x = torch.randn(3, 5, H, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    a, b = ref(x), model(x2)
    upstream = torch.randn(a.shape)
    (a * upstream).sum().backward()
    (b * upstream).sum().backward()
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
    assert model.experts.gate_up_proj.grad[E:].abs().max() == 0  # the zero experts' rows: never read


def test_zero_experts_that_are_not_identity_are_unmatched_with_the_reason() -> None:
    [g] = describe(_Model(lambda: _Block(_ZeroExperts(identity=False))), None)["groups"]
    assert g["archetype"] is None, g
    assert "differs" in g["reason"] and "zero (identity) experts" in g["reason"], g["reason"]


def test_unequal_expert_dims_that_are_not_zero_experts_are_refused() -> None:
    doc = describe(_Model(lambda: _Block(_UnequalNotZero())), None)
    assert doc["groups"] == []
    [f] = doc["non_contract"]
    assert f["kind"] == "unequal-expert-dims" and "gate_up_proj 4, down_proj 6" in f["reason"], f
    assert "zero (identity) experts" in f["reason"] and f["action"]


def _layer(zero_experts: int = 0, top_k: int = 2) -> MoELayerSpec:
    shape = MLPShape(hidden=8, intermediate=3, matmul_params=72, params=72)
    return MoELayerSpec("model.layers.0.mlp", 0, "Block", 4, top_k, 8, shape, None, False,
                        router_params=(4 + zero_experts) * 8, zero_experts=zero_experts,
                        zero_params=zero_experts * 48)


def test_zero_experts_cost_no_expert_flops_and_no_exchange_bytes() -> None:
    plain, par, work, prec = Knobs(dedup=False), Parallel(ep=2), Workload(4, 2), Precision.of(2)
    # every slot routed to a zero expert (ids 4, 5): nothing dispatched, nothing computed by an expert
    c = layer_cost(_layer(2), par, work, prec, histogram=[0, 0, 0, 0, 7, 9], knobs=plain)
    assert c.forward.routed == 0 and c.loads.rows == (0, 0)
    ex = c.exchange
    assert ex.rows_sent == ex.rows_received == ex.bytes_sent == ex.bytes_received == ex.combine_bytes_sent == 0
    # uniform over 4 routed + 4 zero experts at top-2: the FFN experts see what top-1 over 4 gives them
    z, one = layer_cost(_layer(4), par, work, prec, knobs=plain), layer_cost(_layer(0, 1), par, work, prec, knobs=plain)
    assert z.forward.routed == one.forward.routed and z.exchange.bytes_sent == one.exchange.bytes_sent
    assert z.forward.router == 2 * work.tokens() * 8 * 8  # logits over every id, zero experts too
    dedup = layer_cost(_layer(4), par, work, prec)
    assert dedup.exchange.rows_sent < layer_cost(_layer(0), par, work, prec).exchange.rows_sent
    # their unused gate/up rows are kept on every rank: replicated memory
    assert z.memory.replicated_params == one.memory.replicated_params + 4 * 48 * prec.param + 4 * 8 * prec.param


def longcat_holds_zero_experts() -> bool:
    """transformers up to 5.24 keeps LongCat-Flash's zero experts as rows of its experts' up weight;
    from 5.25 its block takes them (identity output, their slots remapped to routed experts at weight 0)."""
    experts = build_tiny_model(tiny_config("longcat_flash"), seed=0, device="meta").model.layers[0].mlp.experts
    return experts.gate_up_proj.shape[0] > experts.down_proj.shape[0]


def test_longcat_spec_counts_routed_experts_only() -> None:
    model = build_tiny_model(tiny_config("longcat_flash"), seed=0)
    spec = model_spec(model, model.config, parse_plan("version: 1\nep_size: 2\n"))
    [lay, _] = spec.layers
    hidden, inter = 64, model.config.expert_ffn_hidden_size
    zero = 2 if longcat_holds_zero_experts() else 0
    assert (lay.num_experts, lay.zero_experts, lay.archetype["layout"]) == \
        (8, zero, "fused-zero-experts" if zero else "fused")
    assert lay.routed.matmul_params == 3 * inter * hidden and lay.zero_params == zero * 2 * inter * hidden


@pytest.mark.parametrize("declared", [E, E + Z])
def test_a_declared_num_experts_may_count_the_zero_experts_or_not(declared: int) -> None:
    def make():
        experts = _ZeroExperts()
        experts.num_experts = declared
        return _Block(experts)

    [s, _] = find_blocks(_Model(make))
    assert (s.num_experts, s.zero_experts) == (E, Z)


def test_zero_expert_slots_pass_through_capacity_and_the_other_runtime_knobs(tmp_path) -> None:
    indices = torch.tensor([[0, E], [0, 1], [E, 0]])  # E: a zero expert's slot, as dispatch hands it on
    weights = torch.tensor([[0.5, 0.0], [0.3, 0.2], [0.0, 0.9]])
    kept = apply_capacity(indices, weights, E, capacity_factor=1.0)  # 2 slots per expert: expert 0 drops 0.3
    assert kept.indices.tolist() == [[0, E], [E, 1], [E, 0]]
    assert torch.equal(kept.weights[1], weights[1] * torch.tensor([0, 1]))
    assert kept.dropped.tolist() == [1, 0, 0, 0]
    r = compare("longcat_flash", str(tmp_path), capacity_factor=100.0, chunks=2, compute="eager", overlap=False,
                defer_expert_grads=True)
    assert len(r["patched"]) == 2 and r["worst_err"] <= TOL, r
