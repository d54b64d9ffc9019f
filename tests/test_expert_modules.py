"""Experts held as module lists, found by structure (#23 item 2): the roles of each expert's Linear
children and its activation are read from the expert's own forward, whatever their names, with or
without biases; the block is then confirmed by execution. A list of dense MLPs with no router beside
it is no experts holder."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hp_rewrite.match.archetype import choose_archetype
from hp_rewrite.match.structure import find_blocks, find_experts_holders
from hp_rewrite.runtime import binding_of
from hp_rewrite.runtime.compute.experts import ExpertsLayout

H, W, E = 16, 12, 4  # hidden, expert width, experts


class GeluGated(nn.Module):  # transformers-style names, the activation an attribute, biases
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, W), nn.Linear(H, W)
        self.down_proj, self.act_fn = nn.Linear(W, H), nn.GELU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class UpFirstTanh(nn.Module):  # unknown names, the up projection defined first, gelu(tanh) inline
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(H, W, bias=False), nn.Linear(H, W, bias=False), nn.Linear(W, H, bias=False)

    def forward(self, x):
        return self.c(self.a(x) * F.gelu(self.b(x), approximate="tanh"))


class PlainRelu(nn.Module):  # a two-layer MLP with biases (Switch / NLLB style)
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, W), nn.Linear(W, H)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    """Routing written inline: softmax top-2, renormalised, as the original Mixtral code."""

    def __init__(self, expert_cls, router: bool = True):
        super().__init__()
        self.top_k = 2
        if router:
            self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([expert_cls() for _ in range(E)])

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        w, idx = torch.topk(torch.softmax(self.gate(x), -1, dtype=torch.float), 2, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out.reshape(shape)


class Model(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block


@pytest.mark.parametrize(("expert_cls", "roles", "act"), [
    (GeluGated, ("gate_proj", "up_proj", "down_proj"), ("attr", "act_fn")),
    (UpFirstTanh, ("b", "a", "c"), ("fn", "gelu_tanh")),
    (PlainRelu, (None, "fc1", "fc2"), ("fn", "relu")),
])
def test_roles_read_from_the_expert_and_the_block_confirmed(expert_cls, roles, act) -> None:
    model = Model(Block(expert_cls))
    layout = ExpertsLayout.of(model.block.experts)
    strip = lambda name: name and name.rsplit(".", 1)[0]  # noqa: E731
    assert (strip(layout.gate), strip(layout.up), strip(layout.down)) == roles and layout.module_act == act
    assert layout.expert_keys == ("0", "1", "2", "3") and layout.gated == (roles[0] is not None)
    has_bias = expert_cls is not UpFirstTanh
    assert bool(layout.up_bias) == bool(layout.down_bias) == has_bias
    (s,) = find_blocks(model)
    result = choose_archetype(s, recorded_router=False)
    assert result.archetype is not None, result.reason
    assert (result.archetype.level, result.archetype.router) == ("block", "softmax_topk")
    assert result.archetype.layout.startswith("modules-")


def test_a_list_of_dense_mlps_without_a_router_is_not_an_experts_holder() -> None:
    assert find_experts_holders(Model(Block(GeluGated, router=False))) == []


def test_deferred_expert_gradients_are_refused_for_expert_modules() -> None:
    """runtime.defer_expert_grads cannot defer the gradients of stacked weights: an error, not a no-op."""
    from hp_rewrite.runtime.binding.install import install_expert_parallel
    from hp_rewrite.runtime.errors import ExpertParallelError
    from hp_rewrite.runtime.group.groups import ExpertParallelGroup
    from hp_rewrite.runtime.options import RuntimeOptions

    block = Block(GeluGated)
    with pytest.raises(ExpertParallelError, match="defer_expert_grads: ModuleList keeps its experts as modules"):
        install_expert_parallel(block.experts, num_experts=E, ep=ExpertParallelGroup.single(),
                                options=RuntimeOptions(defer_expert_grads=True))


@pytest.mark.parametrize("expert_cls", [GeluGated, UpFirstTanh, PlainRelu])
def test_expert_modules_run_grouped_without_a_stacked_copy_kept(expert_cls) -> None:
    """The held experts' weights reach grouped_mm without a differentiable stack: no ``[E, ., .]``
    tensor is saved for the backward (grouped_mm's own node would save the stacked weights), and the
    output and every gradient are the unmodified block's."""
    import copy

    from hp_rewrite.runtime.binding.install import install_expert_parallel
    from hp_rewrite.runtime.group.groups import ExpertParallelGroup
    from hp_rewrite.runtime.options import RuntimeOptions
    from hp_rewrite.runtime.pipeline.dispatch import moe_forward

    torch.manual_seed(0)
    ref = Block(expert_cls)
    blk = copy.deepcopy(ref)
    opts = RuntimeOptions()
    install_expert_parallel(blk.experts, num_experts=E, ep=ExpertParallelGroup.single(), options=opts)
    x = torch.randn(10, H)
    x_ref, x_ep = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref_out = ref(x_ref)
    w, idx = torch.topk(torch.softmax(blk.gate(x_ep), -1, dtype=torch.float), 2, dim=-1)
    out = moe_forward(x_ep, idx, w / w.sum(-1, keepdim=True), blk.experts, binding=binding_of(blk.experts))
    nodes, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in nodes:
            nodes.add(fn)
            todo.extend(f for f, _ in fn.next_functions)
    saved = []
    for n in nodes:
        saved += [getattr(n, a) for a in dir(n) if a.startswith("_saved_")]
        saved += list(getattr(n, "saved_tensors", ()) or ())
    stacked = [t.shape for t in saved if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == E]
    assert not stacked and any(type(n).__name__ == "_StackedGroupedMMBackward" for n in nodes), stacked
    g = torch.randn(out.shape)
    (ref_out * g).sum().backward()
    (out * g).sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_ep.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    ref_params = dict(ref.named_parameters())
    for name, p in blk.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-5, msg=name)
