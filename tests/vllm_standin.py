"""A recording stand-in for vLLM's engine (vLLM does not run on these CPU machines), put under TRL's
real ``VLLMGeneration``: ``LLM`` for ``vllm_mode="colocate"`` (its model runner's ``load_weights``
records what it is given) and ``VLLMClient`` for ``"server"`` (``update_named_params`` records the
metadata and the tensors). Everything above the engine is TRL's own code.

The names vLLM's own loaders accept, read from their source (vllm/model_executor/models/):

* ``qwen3_moe.py`` and ``deepseek_v2.py`` (DeepSeek-V3): the routed experts through
  ``FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
  ckpt_up_proj_name="up_proj", num_experts=...)``: one 2-D tensor per expert and projection,
  ``...mlp.experts.{i}.{gate,up,down}_proj.weight``; the rest under the Hub's names;
* ``gpt_oss.py`` (unquantised): ``...mlp.experts.gate_up_proj`` / ``down_proj`` (and ``_bias``), the
  full fused ``[E, ...]`` tensors, each rank of vLLM's EP narrowing its experts' rows itself.
"""

from __future__ import annotations

import contextlib
import re
from types import SimpleNamespace

PER_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def vllm_name_problems(family: str, streamed: list, num_experts: int) -> list[str]:
    """Expert tensors of ``streamed`` that vLLM's loader for ``family`` would not take."""
    problems = []
    for name, t in streamed:
        if ".mlp.experts." not in name:
            continue
        if family == "gpt_oss":
            if not FUSED.search(name) or t.shape[0] != num_experts:
                problems.append(f"{family}: vLLM's gpt-oss loader takes no {name} {list(t.shape)}")
        else:
            m = PER_EXPERT.search(name)
            if m is None or int(m.group(1)) >= num_experts or t.dim() != 2:
                problems.append(f"{family}: vLLM's loader takes no {name} {list(t.shape)}")
    return problems


class RecordingLLM:
    """vLLM's ``LLM`` as ``VLLMGeneration`` reaches it for a weight sync."""

    def __init__(self, model, **kwargs) -> None:
        self.model_name, self.kwargs, self.loaded, self.resets = model, kwargs, [], 0
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load_weights))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)))

    def _load_weights(self, weights) -> set[str]:
        got = [(name, t.detach().clone()) for name, t in weights]
        self.loaded += got
        return {n for n, _ in got}

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass


class RecordingClient:
    """TRL's ``VLLMClient`` (the server's side of the weight update) as ``VLLMGeneration`` calls it."""

    def __init__(self, base_url=None, group_port=None, connection_timeout=None, **kwargs) -> None:
        self.metadata, self.received, self.resets = None, [], 0

    def init_communicator(self, device=None) -> None:
        pass

    def update_named_params(self, metadata, params) -> None:
        self.metadata = list(metadata)
        self.received += [(name, t.detach().clone()) for name, t in params]

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}


@contextlib.contextmanager
def vllm_standin():
    """TRL's vLLM paths with the recording engine and client in place of vLLM's."""
    from trl.generation import vllm_generation as vg

    saved = {k: getattr(vg, k, None) for k in ("is_vllm_available", "LLM", "VLLMClient")}
    vg.is_vllm_available, vg.LLM, vg.VLLMClient = (lambda *a, **k: True), RecordingLLM, RecordingClient
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(vg, k, v)
