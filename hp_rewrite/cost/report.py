"""Rich tables for ``hp-rewrite cost`` and ``hp-rewrite profile`` (formatting only, no arithmetic
beyond unit scaling). Consecutive layers with identical costs share one row, so a 58-layer
DeepSeek-V3 without a histogram prints one line per kind of layer instead of 58 equal ones."""

from __future__ import annotations

from rich.table import Table

from .hardware import Hardware
from .per_rank import LayerCost, ModelCost
from .profile import RoutingProfile
from .ranking import Candidate
from .timing import StepTime


def _si(x: float, unit: str = "") -> str:
    """``1.67e14`` -> ``167T``: three significant digits and an SI prefix (999.9M prints as 1G)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale * 0.9995:
            return f"{x / scale:.3g}{prefix}{unit}"
    return f"{x:.3g}{unit}"


def _gb(b: float) -> str:
    return f"{b / 1e9:.3g}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.4g}"


def _signature(c: LayerCost) -> tuple:
    return (c.local_experts, c.loads.rows, c.forward, c.exchange, c.memory)


def _groups(layers: tuple[LayerCost, ...]) -> list[list[LayerCost]]:
    groups: list[list[LayerCost]] = []
    for c in layers:
        if groups and _signature(groups[-1][-1]) == _signature(c):
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def _label(group: list[LayerCost]) -> str:
    first, last = group[0], group[-1]
    name = lambda c: str(c.layer) if c.layer is not None else c.path  # noqa: E731
    return name(first) if len(group) == 1 else f"{name(first)}-{name(last)} (x{len(group)})"


def cost_table(cost: ModelCost, specs: dict) -> Table:
    p, w = cost.parallel, cost.workload
    table = Table(
        title=f"{cost.model_type}: MoE cost per rank (busiest rank of each layer), ep={p.ep} etp={p.etp} "
        f"tp={p.tp} cp={p.cp}, seq {w.seq_len} x micro-batch {w.micro_batch}, "
        f"{cost.precision.act}-byte activations; FLOP forward unless noted"
    )
    cols = (
        "layers",
        "E/rank",
        "k",
        "I rt/sh",
        "rows max/mean",
        "imb.",
        "router",
        "routed",
        "shared",
        "combine",
        "fwd",
        "fwd+bwd",
        "a2a B f+b",
        "mem B",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "layers" else "right")
    for group in _groups(cost.layers):
        c, n = group[0], len(group)
        lay = specs[c.path]
        f = c.forward
        table.add_row(
            _label(group),
            str(c.local_experts),
            str(lay.top_k),
            f"{lay.routed.intermediate}/{lay.shared.intermediate if lay.shared else '-'}",
            f"{_si(c.loads.busiest)}/{_si(c.loads.mean)}",
            f"{c.loads.imbalance:.3g}",
            _si(f.router * n),
            _si(f.routed * n),
            _si(f.shared * n),
            _si(f.combine * n),
            _si(f.total * n),
            _si(c.step_flops * n),
            _si(c.exchange.step_bytes * n),
            _si(c.memory.total * n),
        )
    total = lambda attr: sum(getattr(c.forward, attr) for c in cost.layers)  # noqa: E731
    table.add_row(
        "total",
        "",
        "",
        "",
        "",
        f"{cost.max_imbalance:.3g}",
        _si(total("router")),
        _si(total("routed")),
        _si(total("shared")),
        _si(total("combine")),
        _si(cost.forward_flops),
        _si(cost.forward_flops + cost.backward_flops),
        _si(cost.step_bytes),
        _si(cost.memory),
        style="bold",
    )
    return table


def memory_lines(cost: ModelCost, hw: Hardware, reserve: float, kept: str | None = None) -> list[str]:
    m = [c.memory for c in cost.layers]
    experts = sum(x.expert_params + x.expert_grads + x.expert_optimizer for x in m)
    repl = sum(x.replicated_params + x.replicated_grads + x.replicated_optimizer for x in m)
    act = sum(x.activations for x in m)
    cap = hw.memory_bytes - reserve
    verdict = "fits" if cost.memory <= cap else "DOES NOT FIT"
    rank = cost.precision.lora_rank
    states = "expert weights+grads+Adam" if not rank else (
        f"frozen expert weights ({kept} kept)" if kept else "frozen expert weights") + f" + LoRA r={rank} states"
    return [
        f"memory per rank (MoE layers): {states} {_gb(experts)} GB, replicated router/shared "
        f"{_gb(repl)} GB, activations {_gb(act)} GB -> {_gb(cost.memory)} GB of {_gb(cap)} GB on {hw.name}: {verdict}",
        f"not costed: {cost.other_params / 1e9:.3g} G parameters outside the costed MoE layers (attention, embeddings, "
        "dense MLPs), replicated on every EP rank; keep room with --reserve-gb",
    ]


def time_line(st: StepTime, hw: Hardware) -> str:
    return (
        f"time per micro-batch, MoE layers fwd+bwd on {hw.name}: {_ms(st.total)} ms (compute {_ms(st.compute)} ms, "
        f"exposed all-to-all {_ms(st.exposed_comm)} ms, all-to-all alone {_ms(st.comm)} ms)"
    )


def suggest_table(cands: list[Candidate], world_size: int, hw: Hardware) -> Table:
    table = Table(
        title=f"EP degrees for world size {world_size} on {hw.name} (fwd+bwd of the MoE layers, "
        "busiest rank, per micro-batch of a TP or context group; ranked by the world's tokens/s)"
    )
    for col in (
        "#",
        "ep",
        "tp",
        "cp",
        "E/rank",
        "dp",
        "max imb.",
        "compute ms",
        "a2a+tp+cp ms",
        "exposed ms",
        "step ms",
        "tokens/s",
        "mem GB/rank",
        "fits",
        "bound",
    ):
        table.add_column(col, justify="right")
    dp_mode = next((c.data_parallel.mode for c in cands if c.data_parallel is not None), None)
    if dp_mode is not None:
        table.title = (f"EP degrees for world size {world_size} on {hw.name}, non-expert weights {dp_mode} (fwd+bwd "
                       "of the MoE layers, busiest rank, per micro-batch; memory: every weight's states + MoE "
                       "activations)")
        table.add_column("DP GB/step", justify="right")
        table.add_column("DP ms (exposed)", justify="right")
    for i, c in enumerate(cands, 1):
        local = {lay.local_experts for lay in c.cost.layers}
        row = [
            str(i),
            str(c.ep),
            str(c.tp),
            str(c.cp),
            "/".join(str(x) for x in sorted(local)),
            str(world_size // c.ep),
            f"{c.cost.max_imbalance:.3g}",
            _ms(c.time.compute),
            _ms(c.time.comm),
            _ms(c.time.exposed_comm),
            _ms(c.step_s),
            f"{c.tokens_per_s:.3g}",
            _gb(c.memory_bytes),
            "yes" if c.feasible else f"no: {c.reason}",
            c.bound,
        ]
        if dp_mode is not None:
            dp = c.data_parallel
            row += [_gb(dp.comm_bytes), f"{_ms(dp.comm_s)} ({_ms(c.dp_exposed_s)})"]
        table.add_row(*row, style="bold" if i == 1 and c.feasible else None)
    return table


def profile_table(profile: RoutingProfile, ep: int) -> Table:
    table = Table(
        title=f"{profile.model_type}: routing of {profile.num_tokens} tokens (top-k {profile.top_k}), "
        f"grouped for ep={ep}"
    )
    columns = ("layer", "path", "min/max tokens per expert", "rank loads", "busiest rank", "imbalance",
               "imbalance if balanced")
    for col in columns:
        table.add_column(col, justify="right")
    for lay in profile.layers:
        loads = lay.loads(ep)
        t = lay.tokens_per_expert
        table.add_row(
            str(lay.layer),
            lay.path,
            f"{min(t)}/{max(t)}",
            " ".join(f"{x:g}" for x in loads.rows),
            str(loads.busiest_rank),
            f"{loads.imbalance:.3f}",
            f"{lay.balanced_loads(ep).imbalance:.3f}",
        )
    return table


def colocated_table(report) -> Table:
    """RL with vLLM colocated: what each rank holds, line by line, and whether it fits the device."""
    hw, total = report.hardware, report.colocated_total
    verdict = "fits" if total <= hw.memory_bytes else "does NOT fit"
    table = Table(title=f"RL with vLLM colocated, per GPU on {hw.name}: {_gb(total)} GB of {_gb(hw.memory_bytes)} GB, "
                  f"{verdict} (estimated; keep a few GB for the CUDA context, NCCL and fragmentation)")
    for col, justify in (("", "left"), ("GB", "right"), ("", "left")):
        table.add_column(col, justify=justify)
    for line in report.colocated:
        table.add_row(line.name, _gb(line.bytes), line.note)
    return table
