"""``hp-rewrite describe-moe MODEL_DIR [--json]``: what hp-rewrite sees in a checkpoint, and why.

The diagnosis is :func:`hp_rewrite.match.diagnosis.diagnose` on the model built on the meta device
from config.json alone; this module parses the arguments, builds the model and prints the records as
JSON or as trees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape as esc

from .common import console, typed

if TYPE_CHECKING:
    from ..match.diagnosis import BlockGroup, Diagnosis
    from ..match.misfits import Children, Misfit, Shapes


@dataclass(frozen=True)
class DescribeArgs:
    model_dir: Path
    json: bool
    trust_remote_code: bool = False


def register(sub) -> None:
    des = sub.add_parser(
        "describe-moe",
        help="list the MoE blocks of a checkpoint (config.json only): structure, "
        "the archetype hp-rewrite would use or why none fits, and a plan to start from",
    )
    des.add_argument(
        "model_dir", type=Path, help="transformers checkpoint directory (only config.json is read)"
    )
    des.add_argument("--json", action="store_true", help="print a JSON document on stdout instead of tables")
    des.add_argument("--trust-remote-code", action="store_true",
                    help="run the checkpoint's own modeling code (its config.json auto_map), as transformers' "
                    "trust_remote_code=True; read that code first")
    des.set_defaults(run=lambda ns: describe_moe(typed(DescribeArgs, ns)))


def describe_moe(args: DescribeArgs) -> int:
    """Exit 0 with a report (also when there is no MoE); ModelDirError for an unusable directory."""
    from ..errors import ModelDirError
    from ..hf import load_config, meta_model, quiet_transformers, short_error
    from ..loading.quantized import load_note
    from ..match.diagnosis import diagnose

    with quiet_transformers():
        config = load_config(args.model_dir, args.trust_remote_code)
        try:
            model = meta_model(config)
        except ModelDirError as e:
            raise ModelDirError(f"{args.model_dir}/config.json: {e}") from e
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
            raise ModelDirError(f"{args.model_dir}/config.json: transformers cannot build the model from this config "
                                f"({short_error(e)}); fix the config (or report it upstream) and retry") from e
    checkpoint = load_note(config, str(args.model_dir))  # refuses what cannot be loaded
    diagnosis = diagnose(model, config).with_checkpoint(checkpoint)
    if args.json:  # the document round-trips through Diagnosis records: the kernel line is console-only
        print(json.dumps(diagnosis.to_json(), indent=2))
    else:
        print_report(diagnosis)
        for k in kernel_rows(model, config):
            console.print(f"expert compute here ({k['device']}, {k['dtype']}, runtime.compute {k['requested']}, "
                          f"experts_implementation {k['experts_implementation']}): "
                          f"[bold]{k['backend']}[/] - {esc(k['reason'])}", highlight=False)
    return 0


def kernel_rows(model, config) -> list[dict]:
    """The expert-compute backend ``runtime.compute: auto`` would choose on this host for the model's
    ``experts_implementation``, per distinct experts shape, and why (hp_rewrite.kernels)."""
    import torch

    from ..kernels import npu
    from ..runtime.compute.experts import ExpertsLayout, experts_implementation_of, kernel_choice
    from ..runtime.errors import ExpertParallelError
    from ..tiny import experts_holders

    if torch.cuda.is_available():
        device = "cuda"
    elif npu.available() and getattr(torch, "npu", None) is not None and torch.npu.is_available():
        device = "npu"
    else:
        device = "cpu"
    dtype = getattr(config.get_text_config(), "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    rows: dict[tuple, dict] = {}
    for _, m, _ in experts_holders(model):
        try:
            layout = ExpertsLayout.of(m)
        except ExpertParallelError:
            continue
        c = kernel_choice("auto", m, device, dtype, layout, weight_dtype=dtype)
        rows.setdefault((c.backend, c.reason), {"device": device, "dtype": str(dtype).replace("torch.", ""),
                                                "experts_implementation": experts_implementation_of(m), **c.as_dict()})
    return list(rows.values())


# -- console rendering -----------------------------------------------------------------------------


def _shapes(params: Shapes) -> str:
    return ", ".join(f"{k} {list(v)}" for k, v in params) or "none"


def _children(children: Children) -> str:
    return ", ".join(f"{name} ({cls})" for name, cls in children)


def print_report(report: Diagnosis | dict) -> None:
    """Print a :class:`~hp_rewrite.match.diagnosis.Diagnosis` (or its JSON document) as trees."""
    from ..match.diagnosis import Diagnosis
    from ..match.snippets import UNTOUCHED

    d = report if isinstance(report, Diagnosis) else Diagnosis.from_json(report)
    if d.note:
        console.print(f"[yellow]note:[/] {esc(d.note)}", highlight=False)
    if d.checkpoint:
        console.print(f"checkpoint: {esc(d.checkpoint)}", highlight=False)
    if d.message:
        console.print(f"[bold]{d.model_type}[/]: {esc(d.message)}", highlight=False)
        return
    n_blocks = sum(len(g.paths) for g in d.groups)
    n_bad = sum(len(f.paths) for f in d.misfits)
    head = (
        f"{n_blocks} MoE block(s) in {len(d.groups)} group(s)" if d.groups else "no MoE block hp-rewrite can rewrite"
    )
    if d.misfits:
        head += f"; {n_bad} MoE-like module(s) hp-rewrite does not support ({UNTOUCHED})"
    console.print(f"[bold]{d.model_type}[/] ({d.model_class}): {esc(head)}", highlight=False)
    for g in d.groups:
        _print_group(g)
    for f in d.misfits:
        _print_misfit(f)


def _print_group(g: BlockGroup) -> None:
    from rich.panel import Panel
    from rich.syntax import Syntax
    from rich.tree import Tree

    from ..match.snippets import UNTOUCHED, compact_paths

    st, a = g.facts, g.archetype
    status = "[green]matched[/]" if a else "[yellow]unmatched[/]"
    tree = Tree(f"{status} [bold]{g.block_class}[/] x{len(g.paths)}  {esc(compact_paths(g.paths))}")
    tree.add(esc("children: " + _children(g.children)))
    tree.add(esc("params: " + _shapes(g.params)))
    node = tree.add("structure")
    if st.router:
        router = f"{st.router} ({st.router_class})"
    elif st.router_inside:
        router = f"{st.router_inside} (inside a child: the block's own code routes)"
    else:
        router = "- (no child with weight [experts, hidden])"
    if st.selection_bias:
        router += f", selection bias {st.selection_bias} (routing.bias_update_rate can balance it)"
    node.add(esc(f"router: {router}"))
    top_k = st.top_k if st.top_k is not None else "?"
    node.add(
        esc(
            f"experts: {st.experts} ({st.experts_class}), layout {st.layout}, "
            f"{st.num_experts} experts, hidden {st.hidden_size}, top-k {top_k}"
        )
    )
    if st.expert_modules:
        node.add(esc(f"expert modules: {st.expert_modules}"))
    node.add(esc(f"shared expert: {st.shared or '-'}"))
    node.add(esc(f"shared gate: {st.shared_gate or '-'}"))
    node.add(esc(f"other children: {', '.join(st.others) or '-'}"))
    if a:
        arch = tree.add(
            f"archetype: [green]{a.level}-level[/], router {a.router}, shared {a.shared}, layout {a.layout}"
        )
        if a.level == "experts" and g.tried:
            why = arch.add("block level not used:")
            for t in g.tried:
                why.add(esc(t), highlight=False)
    else:
        reason = tree.add("[yellow]no archetype fits[/]; the block is " + UNTOUCHED)
        for why in g.reason.split("; "):
            reason.add(esc(why), highlight=False)
        tree.add(esc(f"what to do: {g.action}"))
    console.print(tree, highlight=False)
    console.print(Panel(Syntax(g.plan_snippet, "yaml"), title="plan to start from", expand=False))


def _print_misfit(f: Misfit) -> None:
    from rich.tree import Tree

    from ..match.snippets import compact_paths

    tree = Tree(f"[red]not supported[/] [bold]{f.module_class}[/] x{len(f.paths)}  {esc(compact_paths(f.paths))}")
    tree.add(esc("children: " + (_children(f.children) or "none")))
    tree.add(esc("params: " + _shapes(f.params)))
    tree.add(esc(f"why: {f.reason}"))
    tree.add(esc(f"what to do: {f.action}"))
    console.print(tree, highlight=False)
