"""Expert-parallel parity cases, run on every rank of a real gloo world (see hp_rewrite/launch.py).

Each case builds an unmodified transformers MoE block (or, for layouts no transformers 5.x class
uses, a small module with its own plain reference), runs it with *all* experts on the global batch
as the reference, then runs the expert-parallel version on this rank's slice of the batch and
compares the output and every gradient: input, router, each expert's weights on the owning rank,
shared expert and shared gate. Gradients of replicated parameters are summed over the world (the
loss is a sum over the global batch), expert gradients over the ranks holding the same experts.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_rewrite.runtime import (
    call_router_module,
    dispatch,
    experts_and_combine,
    installed,
    merge_shared,
    shared_beside,
    sigmoid_group,
    softmax_topk,
)
from hp_rewrite.runtime.binding.install import install_expert_parallel
from hp_rewrite.runtime.compute import experts as experts_module
from hp_rewrite.runtime.compute.experts import ExpertsLayout
from hp_rewrite.runtime.group.groups import (
    ExpertPlacement,
    backend_name,
    build_expert_parallel_group,
    world_timeout,
)
from hp_rewrite.runtime.options import RuntimeOptions
from hp_rewrite.runtime.pipeline.capacity import apply_capacity
from hp_rewrite.runtime.pipeline.dispatch import moe_forward

H, I, E = 32, 16, 8  # noqa: E741 - the usual MoE size names
FP32_TOL = 1e-5
BF16_TOL = 3e-2  # relative to the largest reference magnitude; bf16 has 8 mantissa bits


# ----------------------------------------------------------------------------------------------
# Layouts no transformers 5.x class stores in memory: separate 3-D gate/up/down (or w1/w3/w2).
class SeparateExperts(nn.Module):
    def __init__(self, names=("gate_proj", "up_proj", "down_proj"), transposed=False):
        super().__init__()
        self.names, self.transposed = names, transposed
        g, u, d = names
        shape_in = (E, H, I) if transposed else (E, I, H)
        shape_out = (E, I, H) if transposed else (E, H, I)
        setattr(self, g, nn.Parameter(torch.randn(shape_in) * 0.2))
        setattr(self, u, nn.Parameter(torch.randn(shape_in) * 0.2))
        setattr(self, d, nn.Parameter(torch.randn(shape_out) * 0.2))
        self.num_experts = E
        self.is_transposed = transposed
        self.act_fn = nn.SiLU()

    def forward(self, hidden, top_k_index, top_k_weights):  # plain per-slot reference
        g, u, d = (getattr(self, n) for n in self.names)
        out = torch.zeros_like(hidden)
        for t in range(hidden.shape[0]):
            for k in range(top_k_index.shape[1]):
                e = int(top_k_index[t, k])
                x = hidden[t]
                if self.transposed:
                    y = (self.act_fn(x @ g[e]) * (x @ u[e])) @ d[e]
                else:
                    y = d[e] @ (self.act_fn(g[e] @ x) * (u[e] @ x))
                out[t] = out[t] + y * top_k_weights[t, k]
        return out


class SeparateBlock(nn.Module):
    def __init__(self, names, transposed=False):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = SeparateExperts(names, transposed)

    def forward(self, x):
        h = x.reshape(-1, H)
        r = softmax_topk(self.gate(h), 2, renormalize=True)
        return self.experts(h, r.indices, r.weights).view_as(x)


# ----------------------------------------------------------------------------------------------
def _randomize(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if "bias" in name else 0.2))
        for _, b in module.named_buffers():
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def build_block(family: str) -> nn.Module:
    """A tiny unmodified MoE block, fp32, experts implementation = transformers eager loop."""
    torch.manual_seed(0)
    if family in ("qwen3", "qwen3_contract"):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as B

        cfg = Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2, norm_topk_prob=True
        )
    elif family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as B

        cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2)
    elif family == "qwen2":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as B

        cfg = Qwen2MoeConfig(
            hidden_size=H,
            moe_intermediate_size=I,
            shared_expert_intermediate_size=24,
            num_experts=E,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        )
    elif family == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as B

        cfg = DeepseekV3Config(
            hidden_size=H,
            moe_intermediate_size=I,
            n_routed_experts=E,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
    elif family == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as B

        cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2)
    elif family == "aria":
        from transformers import AriaTextConfig
        from transformers.models.aria.modeling_aria import AriaTextMoELayer as B

        cfg = AriaTextConfig(
            hidden_size=H, intermediate_size=I, moe_num_experts=E, moe_topk=2, moe_num_shared_experts=1
        )
    elif family == "openai_pf":
        from transformers.models.openai_privacy_filter.configuration_openai_privacy_filter import (
            OpenAIPrivacyFilterConfig,
        )
        from transformers.models.openai_privacy_filter.modeling_openai_privacy_filter import (
            OpenAIPrivacyFilterMLP as B,
        )

        cfg = OpenAIPrivacyFilterConfig(
            hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2
        )
    elif family == "laguna":
        from transformers import LagunaConfig
        from transformers.models.laguna.modeling_laguna import LagunaSparseMoeBlock as B

        cfg = LagunaConfig(
            hidden_size=H,
            moe_intermediate_size=I,
            shared_expert_intermediate_size=24,
            num_experts=E,
            num_experts_per_tok=2,
            moe_routed_scaling_factor=1.7,
        )
    elif family == "nemotron_h":
        from transformers import NemotronHConfig
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        cfg = NemotronHConfig(
            hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=2
        )
        cfg._experts_implementation = "eager"
        blk = nn.Module()
        blk.gate = nn.Linear(H, E, bias=False)
        blk.experts = NemotronHExperts(cfg)
        _randomize(blk, 1)
        return blk
    elif family == "separate":
        blk = SeparateBlock(("gate_proj", "up_proj", "down_proj"))
        _randomize(blk, 1)
        return blk
    elif family == "w1w3w2_transposed":
        blk = SeparateBlock(("w1", "w3", "w2"), transposed=True)
        _randomize(blk, 1)
        return blk
    else:
        raise KeyError(family)
    cfg._experts_implementation = "eager"
    blk = B(cfg)
    _randomize(blk, 1)
    return blk


def reference_forward(family: str, blk: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The unmodified block on ``h [T,H]`` (or, for test-only layouts, their plain reference)."""
    if family == "nemotron_h":
        r = softmax_topk(blk.gate(h), 2, renormalize=True)
        return blk.experts(h, r.indices, r.weights)
    out = blk(h.view(1, *h.shape))
    if isinstance(out, tuple):  # gpt_oss, openai_pf return (hidden, router_scores)
        out = out[0]
    return out.reshape(h.shape)


def _routed_kw(blk: nn.Module, ep, opts: RuntimeOptions) -> dict:
    """The runtime argument generated code passes: the binding the experts were installed with (its
    options are ``opts``)."""
    binding = installed.binding(blk.experts)
    assert binding.options == opts and (binding.ep.size, binding.ep.rank) == (ep.size, ep.rank)
    return {"binding": binding}


def ep_forward(family: str, blk: nn.Module, h: torch.Tensor, ep, opts: RuntimeOptions) -> torch.Tensor:
    """What generated code does for each archetype, on this rank's tokens ``h [T_local, H]``."""
    if family == "qwen3_contract":  # experts-level archetype: the model's block code, EP experts holder
        return reference_forward("qwen3", blk, h)
    if family == "qwen3":
        r = softmax_topk(F.linear(h, blk.gate.weight), 2, renormalize=True)
        return moe_forward(h, r.indices, r.weights, blk.experts, **_routed_kw(blk, ep, opts))
    if family == "mixtral":
        r = softmax_topk(F.linear(h, blk.gate.weight), 2, renormalize=True, weights_dtype="fp32")
        return moe_forward(h, r.indices, r.weights, blk.experts, **_routed_kw(blk, ep, opts))
    if family == "qwen2":
        r = softmax_topk(F.linear(h, blk.gate.weight), 3, renormalize=False)
        state = dispatch(h, r.indices, r.weights, **_routed_kw(blk, ep, opts))
        shared = shared_beside(state, blk.shared_expert, h)  # queued before the split-size read
        gate_logits = blk.shared_expert_gate(h)
        routed = experts_and_combine(state, blk.experts)
        return merge_shared(routed, shared, "gated", gate_logits=gate_logits)
    if family == "deepseek_v3":
        c = blk.config
        r = sigmoid_group(
            h,
            blk.gate.weight,
            blk.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            num_groups=c.n_group,
            topk_groups=c.topk_group,
            renormalize=c.norm_topk_prob,
            scaling=c.routed_scaling_factor,
        )
        state = dispatch(h, r.indices, r.weights, **_routed_kw(blk, ep, opts))
        shared = shared_beside(state, blk.shared_experts, h)
        return merge_shared(experts_and_combine(state, blk.experts), shared, "additive")
    if family in ("gpt_oss", "openai_pf"):
        r = call_router_module(blk.router, h)
        out = moe_forward(h, r.indices, r.weights, blk.experts, **_routed_kw(blk, ep, opts))
        return out * blk.num_experts if family == "openai_pf" else out
    if family == "aria":
        r = call_router_module(blk.router, h)
        state = dispatch(h, r.indices, r.weights, **_routed_kw(blk, ep, opts))
        shared = shared_beside(state, blk.shared_experts, h)
        return merge_shared(experts_and_combine(state, blk.experts), shared, "additive")
    if family == "laguna":
        r = call_router_module(blk.gate, h)
        state = dispatch(h, r.indices, r.weights, **_routed_kw(blk, ep, opts))
        shared = shared_beside(state, blk.shared_experts, h)
        return merge_shared(
            experts_and_combine(state, blk.experts), shared, "scaled", scale=blk.routed_scaling_factor
        )
    if family in ("nemotron_h", "separate", "w1w3w2_transposed"):
        r = softmax_topk(blk.gate(h), 2, renormalize=True)
        return moe_forward(h, r.indices, r.weights, blk.experts, **_routed_kw(blk, ep, opts))
    raise KeyError(family)


# ----------------------------------------------------------------------------------------------
# Forced routing and capacity: the reference is the unmodified transformers experts holder called
# with the routing the case prescribes (per-rank capacity applied the same way).
def _routing_bias(kind: str, ep_size: int) -> torch.Tensor:
    bias = torch.zeros(E)
    local = E // ep_size
    if kind == "skewed":  # every token to rank 0's experts
        bias[local:] = -1e4
    elif kind == "starve_last":  # nobody routes to the last rank's experts
        bias[E - local :] = -1e4
    elif kind == "hot_expert":  # expert 0 in nearly every token's top-k: hotter than a rank's share at ep > k
        bias[0] = 6.0
    return bias


def forced_route(blk, h, kind, ep_size, top_k=2):
    logits = F.linear(h, blk.gate.weight) + _routing_bias(kind, ep_size).to(h.dtype)
    # top-1 keeps the softmax weight: renormalised it would be the constant 1 and its gradient noise
    return softmax_topk(logits, top_k, renormalize=top_k > 1)


# ----------------------------------------------------------------------------------------------
def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if b is None and a is None:
        return 0.0
    b = torch.zeros_like(a) if b is None else b
    a = torch.zeros_like(b) if a is None else a
    scale = b.float().abs().max().item() if b.numel() else 0.0
    err = (a.float() - b.float()).abs().max().item() if b.numel() else 0.0
    return err / max(scale, 1e-12)


def _slices(tokens: list[int]) -> list[slice]:
    out, s = [], 0
    for n in tokens:
        out.append(slice(s, s + n))
        s += n
    return out


def _placement(kind: str, ep) -> ExpertPlacement:
    """contiguous; interleaved (rank r owns experts e with e % ep == r); balanced (from fixed skewed loads)."""
    if kind == "interleaved":
        return ExpertPlacement(E, ep.size, ep.rank, tuple(sorted(range(E), key=lambda e: (e % ep.size, e))))
    if kind == "balanced":
        return ExpertPlacement.balanced([(7 * e) % 11 + e * e for e in range(E)], ep.size, ep.rank)
    return ExpertPlacement(E, ep.size, ep.rank)


def run_case(case: dict, rank: int, world: int, groups: dict) -> dict:
    family = case["family"]
    dtype = torch.bfloat16 if case.get("dtype") == "bf16" else torch.float32
    ep_size = case.get("ep", world)
    if ep_size not in groups:
        groups[ep_size] = build_expert_parallel_group(ep_size)
    ep = groups[ep_size]
    tokens = case.get("tokens") or [12] * world
    tokens = tokens[:world]
    sl = _slices(tokens)[rank]
    opts = RuntimeOptions(**case.get("options", {}))
    routing = case.get("routing", "natural")
    capacity = opts.capacity_factor is not None

    ref_blk = build_block(family).to(dtype)
    ep_blk = copy.deepcopy(ref_blk)
    for m in ep_blk.modules():  # the reference runs transformers' eager loop; here the plan's compute decides
        if isinstance(getattr(getattr(m, "config", None), "_experts_implementation", None), str):
            m.config._experts_implementation = "grouped_mm"  # transformers' default
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(sum(tokens), H, generator=gen)).to(dtype)
    g = torch.randn(sum(tokens), H, generator=gen).to(dtype)

    # ---- reference: all experts, global batch, one process
    x_ref = x.clone().requires_grad_()
    # "autocast": fp32 weights under bf16 autocast (what Trainer's bf16=True runs), both sides
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.get("autocast", False))
    if routing == "natural" and not capacity:
        with autocast:
            ref_out = reference_forward(family, ref_blk, x_ref)
    else:
        parts = []
        for s in _slices(tokens):
            r = forced_route(ref_blk, x_ref[s], routing, ep_size, case.get("top_k", 2))
            idx, w = r.indices, r.weights
            if capacity:
                idx, w, _ = apply_capacity(
                    idx, w, E, opts.capacity_factor, opts.drop_policy, opts.renormalize_kept
                )
            parts.append(ref_blk.experts(x_ref[s], idx, w))
        ref_out = torch.cat(parts)
    (ref_out * g).sum().backward()

    # ---- expert parallel: this rank's tokens, local experts only
    placement = _placement(case.get("placement", "contiguous"), ep)
    install_expert_parallel(ep_blk.experts, num_experts=E, ep=ep, options=opts, placement=placement)
    x_ep = x[sl].clone().requires_grad_()

    def run_ep():
        if routing == "natural" and not capacity:
            return ep_forward(family, ep_blk, x_ep, ep, opts)
        r = forced_route(ep_blk, x_ep, routing, ep_size, case.get("top_k", 2))
        return moe_forward(x_ep, r.indices, r.weights, ep_blk.experts, **_routed_kw(ep_blk, ep, opts))

    weight_grads = installed.binding(ep_blk.experts).runtime.weight_grads
    jobs_before = weight_grads.jobs_run
    with _GroupedCalls(case.get("watch_grouped", False)) as grouped_calls:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.get("autocast", False)):
            out = run_ep()
        (out * g[sl]).sum().backward()
    deferred_jobs = weight_grads.jobs_run - jobs_before  # runtime.defer_expert_grads: weight-gradient GEMMs

    errors = {"output": _rel(out, ref_out[sl]), "grad/input": _rel(x_ep.grad, x_ref.grad[sl])}
    layout = ExpertsLayout.of(ep_blk.experts)
    expert_names = {f"experts.{n}" for n in layout.weight_names}
    placement = installed.binding(ep_blk.experts).placement
    ref_params = dict(ref_blk.named_parameters())
    for name, p in ep_blk.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grad = grad.detach().float().clone()
        ref_grad = ref_params[name].grad
        if name in expert_names:
            if ep.replica_group is not None:
                dist.all_reduce(grad, group=ep.replica_group)
            ref_grad = None if ref_grad is None else ref_grad[placement.local_index]
        else:
            dist.all_reduce(grad)
        if ref_grad is None and not p.requires_grad:
            continue
        errors[f"grad/{name}"] = _rel(grad, ref_grad)

    result = {"errors": errors}
    if case.get("watch_grouped"):  # grouped_mm never gets a group without rows (nor no rows at all)
        result["grouped_calls"], result["padded"] = grouped_calls.calls, grouped_calls.padded
        result["grouped_ok"] = all(rows > 0 and smallest > 0 for rows, smallest in grouped_calls.calls)
    if opts.defer_expert_grads and ep.size > 1:  # the deferred path ran, and nothing is left queued
        stats = installed.last_stats(ep_blk.experts)
        got_rows = stats.rows_received > 0
        # rows for its own experts defer their weight gradients; a guest's go home through autograd
        ran = deferred_jobs > 0 if not stats.guests else True
        result["deferred_ok"] = (ran == got_rows or stats.guests > 0) and len(weight_grads) == 0
    if family == "qwen3" and routing == "natural" and not capacity:  # stats are per global expert
        r = softmax_topk(F.linear(x[sl], ref_blk.gate.weight), 2, renormalize=True)
        want = torch.bincount(r.indices.reshape(-1), minlength=E)
        result["stats_ok"] = bool(torch.equal(installed.last_stats(ep_blk.experts).tokens_per_expert, want))
    if opts.balance == "auto" and ep.size > 1:  # forced on: rows moved, and the busiest rank got no busier
        stats = installed.last_stats(ep_blk.experts)
        moved = torch.tensor([stats.guests, stats.lent])
        dist.all_reduce(moved, group=ep.group)
        rank_rows = stats.rank_rows.clone()  # this rank's slots per destination rank: summed, the group's loads
        dist.all_reduce(rank_rows, group=ep.group)
        before, after = (rank_rows.max(1).values * ep.size / rank_rows.sum(1).clamp(min=1)).tolist()
        result["balance"] = {"guests": int(moved[0]), "lent": int(moved[1]), "before": before, "after": after}
        result["balance_ok"] = bool(moved[0] > 0 and moved[0] == moved[1] and after <= before)
    if case.get("compare_sync"):  # the async path must equal the sync path bit for bit
        sync_blk = copy.deepcopy(ref_blk)
        sync_opts = RuntimeOptions(**{**case.get("options", {}), "overlap": False})
        install_expert_parallel(sync_blk.experts, num_experts=E, ep=ep, options=sync_opts, placement=placement)
        x_s = x[sl].clone().requires_grad_()
        out_s = ep_forward(family, sync_blk, x_s, ep, sync_opts)
        (out_s * g[sl]).sum().backward()
        same = torch.equal(out_s, out) and torch.equal(x_s.grad, x_ep.grad)
        for (_, p1), (_, p2) in zip(sync_blk.named_parameters(), ep_blk.named_parameters(), strict=True):
            same = same and ((p1.grad is None and p2.grad is None) or torch.equal(p1.grad, p2.grad))
        result["bitwise_sync_equal"] = bool(same)
    tol = case.get("tol", BF16_TOL if dtype == torch.bfloat16 or case.get("autocast") else FP32_TOL)
    worst = max(errors, key=errors.get)
    result.update(
        tol=tol,
        worst=worst,
        worst_err=errors[worst],
        ok=bool(
            errors[worst] <= tol
            and not math.isnan(errors[worst])
            and result.get("bitwise_sync_equal", True)
            and result.get("stats_ok", True)
            and result.get("deferred_ok", True)
            and result.get("grouped_ok", True)
            and result.get("balance_ok", True)
        ),
    )
    return result


def group_facts() -> dict:
    """What the EP groups are built with: the world's timeout unless the plan sets one, once per layout."""
    cpu = torch.device("cpu")
    first, again = build_expert_parallel_group(dist.get_world_size()), build_expert_parallel_group(dist.get_world_size())
    short = build_expert_parallel_group(dist.get_world_size(), timeout_s=7)
    timeout = lambda g: g.group._get_backend(cpu).options._timeout.total_seconds() if g.group else None  # noqa: E731
    return {"reused": first is again and short is not first, "world_timeout": world_timeout().total_seconds(),
            "ep_timeout": timeout(first), "plan_timeout": timeout(short), "backend": backend_name()}


class _Wire:
    """Records every ``all_to_all_single`` (dtype and bytes of what this rank sends) while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self._original = dist.all_to_all_single

    def __enter__(self) -> _Wire:
        def recording(output, input, *args, **kwargs):
            self.calls.append((str(input.dtype).replace("torch.", ""), input.numel() * input.element_size()))
            return self._original(output, input, *args, **kwargs)

        dist.all_to_all_single = recording
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self._original


_ADDING = {"IndexAddBackward0", "ScatterAddBackward0", "IndexPutBackward0", "EmbeddingBackward0"}


def _graph_sums(out: torch.Tensor) -> list[str]:
    """Autograd nodes of ``out``'s graph whose backward adds several contributions into one row in an
    order the device decides (index_add_ / scatter_add_ / index_put_ accumulate; a gather with a repeated
    index has ``index_add_`` as its backward); [] when every such sum runs in a fixed order."""
    bad, seen, todo = [], set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        name = type(fn).__name__
        if name in _ADDING:
            bad.append(name)
        if name in ("IndexSelectBackward0", "IndexBackward0"):
            index = fn._saved_index if name == "IndexSelectBackward0" else fn._saved_indices[0]
            if index is not None and index.unique().numel() != index.numel():
                bad.append(f"{name} with a repeated index")
        todo.extend(f for f, _ in fn.next_functions)
    return bad


def wire_facts(family: str, ep, dedup: bool, chunks: int = 1) -> dict:
    """One bf16 layer at EP=ep.size: the all-to-alls of its forward and backward (dtypes and bytes), and
    whether its autograd graph sums any token's contributions in a device-decided order."""
    blk = build_block(family).to(torch.bfloat16)
    opts = RuntimeOptions(dedup=dedup, chunks=chunks)
    install_expert_parallel(blk.experts, num_experts=E, ep=ep, options=opts)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(dist.get_rank())).to(torch.bfloat16)
    x.requires_grad_()
    with _Wire() as forward:
        out = ep_forward(family, blk, x, ep, opts)
    unordered = _graph_sums(out)  # before the backward frees the saved indices
    with _Wire() as backward:
        out.float().pow(2).sum().backward()
    return {"forward": forward.calls, "backward": backward.calls, "unordered_sums": unordered}


class _GroupedCalls:
    """While active (and ``watch``), records each grouped_mm call's rows and smallest group, and how many
    batches the runtime padded (:func:`hp_rewrite.runtime.compute.batch.pad_empty_groups`)."""

    def __init__(self, watch: bool) -> None:
        self.watch, self.calls, self.padded = watch, [], 0

    def __enter__(self) -> _GroupedCalls:
        if not self.watch:
            return self
        self._mm, self._pad = F.grouped_mm, experts_module.pad_empty_groups

        def mm(x, w, *args, offs=None, **kwargs):
            sizes = torch.diff(offs, prepend=offs.new_zeros(1)) if offs is not None else x.new_full((1,), x.shape[0])
            self.calls.append((x.shape[0], int(sizes.min())))
            return self._mm(x, w, *args, offs=offs, **kwargs)

        def pad(batch, always=False):
            padded = self._pad(batch, always)
            self.padded += padded is not None
            return padded

        F.grouped_mm, experts_module.pad_empty_groups = mm, pad
        return self

    def __exit__(self, *exc) -> None:
        if self.watch:
            F.grouped_mm, experts_module.pad_empty_groups = self._mm, self._pad


def run_all(rank: int, world: int, cases: list[dict]) -> dict:
    groups: dict = {}
    results = {"groups": group_facts()}
    if world > 1:
        ep = build_expert_parallel_group(world)
        results["wire"] = {f"{f}-{'dedup' if d else 'per-slot'}-chunks{c}": wire_facts(f, ep, d, c)
                           for f in ("deepseek_v3", "mixtral", "qwen3") for d in (True, False) for c in (1, 2)}
    for case in cases:
        results[case["name"]] = run_case(case, rank, world, groups)
    return results
