"""Lend hot experts for one step: the rank this batch overloads sends their weights, not their rows.

A placement fixed in advance cannot follow how a batch routes. After the router every rank knows
how many of its slots go to each expert; one small all-gather gives every rank the whole table,
and each rank picks the same experts to lend (a deterministic greedy on the same numbers): those
whose rows from other ranks, once computed where they come from, bring the busiest rank's load
down the most. Every rank then computes its own slots of a lent expert locally, with a copy of the
weights received in one all-to-all (each owner sends its lent experts to every rank); those slots
leave the exchange like dropped ones. The copies' gradients return through the reverse all-to-all
and are summed into the owner's weights, so expert gradients keep their owner and their scale.

The lent experts' math is the experts module's own (its activation, gate, biases, norm), on the
same rows grouped differently, so results differ from the plain path by rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .experts import ExpertsLayout
from .groups import ExpertParallelGroup, ExpertPlacement
from .turns import give_turn


def gather_counts(counts: torch.Tensor, ep: ExpertParallelGroup) -> list[list[int]]:
    """Every rank's slots per expert ``[E]`` -> the table ``[ep][E]`` on every rank (host ints)."""
    table = [torch.empty_like(counts) for _ in range(ep.size)]
    give_turn()
    try:
        dist.all_gather(table, counts.contiguous(), group=ep.group)
    except RuntimeError as e:
        raise comm._peer_failure(ep.group, e) from e
    return torch.stack(table).tolist()


def choose_lent(table: list[list[int]], placement: ExpertPlacement, max_lent: int) -> list[int]:
    """Experts to lend this step (sorted global ids), the same on every rank for the same table.

    Greedy: take the busiest rank (rows its experts receive, all sources); lend the expert of it whose
    rows from other ranks are the most, if that lowers the largest load; repeat up to ``max_lent``.
    """
    ep = placement.ep_size
    owner = {e: r for r in range(ep) for e in placement.experts_of(r)}
    loads = [sum(table[s][e] for s in range(ep) for e in placement.experts_of(r)) for r in range(ep)]
    lent: list[int] = []
    for _ in range(max_lent):
        busiest = max(range(ep), key=lambda r: (loads[r], -r))
        best, best_peak = None, max(loads)
        for e in placement.experts_of(busiest):
            if e in lent:
                continue
            after = list(loads)
            after[busiest] -= sum(table[s][e] for s in range(ep) if s != busiest)
            for s in range(ep):
                if s != busiest:
                    after[s] += table[s][e]
            if max(after) < best_peak:  # strictly better; ties keep the first expert found
                best, best_peak = e, max(after)
        if best is None:
            break
        o = owner[best]
        loads[o] -= sum(table[s][best] for s in range(ep) if s != o)
        for s in range(ep):
            if s != o:
                loads[s] += table[s][best]
        lent.append(best)
    return sorted(lent)


@dataclass
class LentSlots:
    """This rank's routed slots to lent experts, computed here instead of being exchanged."""

    experts: list[int]  # global ids, ascending
    owners: list[int]  # EP rank owning each
    tokens: torch.Tensor  # [n] token of each slot, grouped by lent expert (in ``experts`` order)
    weights: torch.Tensor  # [n] routing weight of each slot
    counts: list[int]  # slots per lent expert


def split_lent(indices: torch.Tensor, weights: torch.Tensor, lent: list[int], table_row: list[int],
               num_experts: int, placement: ExpertPlacement) -> tuple[torch.Tensor, torch.Tensor, LentSlots]:
    """Take the lent experts' slots out of the routing (they get the drop marker and weight 0)."""
    top_k = indices.shape[1]
    lent_ids = torch.tensor(lent, dtype=indices.dtype, device=indices.device)
    is_lent = torch.isin(indices, lent_ids)
    flat = torch.where(is_lent, indices, num_experts).reshape(-1)
    order = torch.sort(flat, stable=True).indices[: sum(table_row[e] for e in lent)]
    slots = LentSlots(
        experts=list(lent),
        owners=[placement.slot_of_expert[e] // placement.num_local for e in lent],
        tokens=torch.div(order, top_k, rounding_mode="floor"),
        weights=weights.reshape(-1).index_select(0, order),
        counts=[table_row[e] for e in lent],
    )
    kept = torch.where(is_lent, num_experts, indices)
    return kept, torch.where(is_lent, torch.zeros_like(weights), weights), slots


class _LentExperts:
    """The experts module's code (activation, gate, norm) over the lent weights ``[n_lent, ...]``."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        self.__dict__["_module"], self.__dict__["_weights"] = module, weights

    def __getattr__(self, name: str):
        weights = self.__dict__["_weights"]
        return weights[name] if name in weights else getattr(self.__dict__["_module"], name)


def lent_experts(module: nn.Module, layout: ExpertsLayout, slots: LentSlots, placement: ExpertPlacement,
                 ep: ExpertParallelGroup) -> _LentExperts:
    """Receive every lent expert's weights (one differentiable all-to-all: each owner sends its lent
    experts to every rank; the backward sums the copies' gradients into the owner's weights)."""
    names = layout.weight_names
    params = [getattr(module, n) for n in names]
    mine = [e for e, o in zip(slots.experts, slots.owners, strict=True) if o == placement.ep_rank]
    rows = [placement.slot_of_expert[e] % placement.num_local for e in mine]
    index = torch.tensor(rows, dtype=torch.long, device=params[0].device)
    # expert-major: each lent expert's tensors back to back, as the receivers cut them
    flat = torch.cat([p.index_select(0, index).flatten(1) for p in params], dim=1).reshape(-1)
    per_expert = sum(p[0].numel() for p in params)
    counts = [sum(1 for o in slots.owners if o == r) * per_expert for r in range(ep.size)]
    received = comm.all_to_all(flat.repeat(ep.size), counts, [flat.numel()] * ep.size, ep.group)
    # received: owner 0's lent experts, then owner 1's, ...: the order of ``slots.experts`` sorted by owner
    by_owner = sorted(range(len(slots.experts)), key=lambda i: (slots.owners[i], slots.experts[i]))
    blocks = received.view(len(slots.experts), per_expert)
    blocks = blocks.index_select(0, torch.tensor(sorted(range(len(by_owner)), key=by_owner.__getitem__),
                                                 dtype=torch.long, device=blocks.device))
    weights, offset = {}, 0
    for name, p in zip(names, params, strict=True):
        n = p[0].numel()
        weights[name] = blocks[:, offset : offset + n].reshape(len(slots.experts), *p.shape[1:])
        offset += n
    return _LentExperts(module, weights)
