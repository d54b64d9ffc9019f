"""An archetype extension (a plan lists it under ``extensions:``): rewrites
:class:`tests.ext_support.TemperatureMoeBlock`, whose router takes a softmax over the top-k logits
divided by a temperature. The module is its own template: ``Params`` declares the placeholders of
``forward``, and ``register_archetype`` ties them to a structural predicate and a derive function.
"""

# ruff: noqa: F821 - the upper-case placeholders are declared by Params, not as globals
import sys
from dataclasses import dataclass

import torch

from hp_rewrite import runtime as hp
from hp_rewrite.codegen.specialize import attribute
from hp_rewrite.match import register_archetype


@dataclass(frozen=True)
class Params:
    ROUTER: str = attribute()
    EXPERTS: str = attribute()
    TOP_K: int = 1
    TEMPERATURE: float = 1.0


def forward(self, hidden_states):
    shape = hidden_states.shape
    hidden = hidden_states.reshape(-1, shape[-1])
    top, index = torch.nn.functional.linear(hidden, self.ROUTER.weight).topk(TOP_K, dim=-1)
    weights = torch.softmax(top / TEMPERATURE, dim=-1)
    state = hp.dispatch(hidden, index, weights, binding=hp.binding_of(self.EXPERTS))
    out = hp.experts_and_combine(state, self.EXPERTS)
    return out.reshape(shape)


def _fits(s) -> bool:
    """A router child, no shared expert, and a float ``temperature`` on the block."""
    return s.router_name is not None and s.shared_name is None and isinstance(getattr(s.block, "temperature", None), float)


@register_archetype("temperature_topk", template=sys.modules[__name__], params=Params, predicate=_fits,
                    describe=lambda p: ("temperature_topk", "none"))
def derive(s, probe):
    return Params(ROUTER=s.router_name, EXPERTS=s.experts_name, TOP_K=s.block.top_k, TEMPERATURE=s.block.temperature)
