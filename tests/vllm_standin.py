"""A recording stand-in for vLLM's engine (vLLM does not run on these CPU machines), put under TRL's
real ``VLLMGeneration``: ``LLM`` for ``vllm_mode="colocate"`` (its model runner's ``load_weights``
records what it is given) and ``VLLMClient`` for ``"server"`` (``update_named_params`` records the
metadata and the tensors). Everything above the engine is TRL's own code. ``LLM.generate`` runs a plain transformers model of the
checkpoint (kept equal to the weights synced into it) as vLLM's engine would: the prompt in one
forward, then one token per step, sampling at the given temperature, stopping at EOS or ``max_tokens``;
built with ``enable_return_routed_experts=True`` it returns, as vLLM does, each completion's
``routed_experts`` ``[prompt + completion - 1, num_hidden_layers, top_k]`` (int32, the experts its
routers chose for every forwarded token; dense layers zero). ``router_noise`` perturbs the engine's
routers after each sync, as an inference engine's own kernels and rounding make it route differently.

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
    """vLLM's ``LLM`` as ``VLLMGeneration`` reaches it: weight syncs recorded (and loaded into the
    generating model), ``generate`` as described above."""

    router_noise = 0.0

    def __init__(self, model, **kwargs) -> None:
        self.model_name, self.kwargs, self.loaded, self.resets = model, kwargs, [], 0
        self.returns_routes = bool(kwargs.get("enable_return_routed_experts"))
        self.returned: list = []  # every completion generated: (prompt ids, completion ids, routed_experts)
        runner = SimpleNamespace(model=SimpleNamespace(load_weights=self._load_weights))
        self.llm_engine = SimpleNamespace(
            model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
            model_config=SimpleNamespace(enable_return_routed_experts=self.returns_routes))
        self.engine = None

    def _engine(self):
        if self.engine is None:
            from transformers import AutoModelForCausalLM

            self.engine = AutoModelForCausalLM.from_pretrained(self.model_name, attn_implementation="eager").eval()
        return self.engine

    def _load_weights(self, weights) -> set[str]:
        import torch

        got = [(name, t.detach().clone()) for name, t in weights]
        self.loaded += got
        engine = self._engine()
        state = engine.state_dict()
        with torch.no_grad():  # the Hub's per-expert tensors into the fused ones transformers holds, as vLLM fuses
            for name, t in got:
                m = PER_EXPERT.search(name)
                if m is None:
                    if state[name].shape == t.shape:  # an unprepared EP model sends slices: recorded, not loaded
                        state[name].copy_(t)
                    continue
                prefix, i = name[: m.start()] + ".mlp.experts.", int(m.group(1))
                if m.group(2) == "down_proj":
                    state[prefix + "down_proj"][i].copy_(t)
                else:
                    rows = t.shape[0]
                    at = slice(0, rows) if m.group(2) == "gate_proj" else slice(rows, 2 * rows)
                    state[prefix + "gate_up_proj"][i, at].copy_(t)
        if self.router_noise:
            gen = torch.Generator().manual_seed(len(self.loaded))
            with torch.no_grad():
                for name, p in engine.named_parameters():
                    if name.endswith("mlp.gate.weight"):
                        p.add_(torch.randn(p.shape, generator=gen) * self.router_noise * p.std())
        return {n for n, _ in got}

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        import torch

        engine, out = self._engine(), []
        gen = torch.Generator().manual_seed(17 + len(self.returned))
        eos, steps = engine.config.eos_token_id, sampling_params.max_tokens
        temperature = sampling_params.temperature or 1.0
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            chosen, hooks = {}, []
            for i, layer in enumerate(engine.model.layers):
                hooks.append(layer.mlp.gate.register_forward_hook(
                    lambda m, a, o, i=i, chosen=chosen: chosen.setdefault(i, []).append(o[2].reshape(-1, o[2].shape[-1]))))
            completion, logprobs, past, step_in = [], [], None, torch.tensor([ids])
            with torch.no_grad():
                for _ in range(steps):
                    result = engine(input_ids=step_in, past_key_values=past, use_cache=True)
                    past = result.past_key_values
                    logp = torch.log_softmax(result.logits[0, -1] / temperature, dim=-1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    completion.append(token)
                    logprobs.append({token: SimpleNamespace(logprob=float(logp[token]), rank=1)})
                    if token == eos:
                        break
                    step_in = torch.tensor([[token]])
            for h in hooks:
                h.remove()
            layers = engine.config.num_hidden_layers
            k = engine.config.num_experts_per_tok
            routes = torch.zeros(len(ids) + len(completion) - 1, layers, k, dtype=torch.int32)
            for i, calls in chosen.items():
                routes[:, i] = torch.cat(calls)[: routes.shape[0]].to(torch.int32)
            self.returned.append((ids, completion, routes))
            completion_out = SimpleNamespace(token_ids=completion, logprobs=logprobs,
                                             routed_experts=routes.numpy() if self.returns_routes else None)
            out.append(SimpleNamespace(prompt_token_ids=ids, outputs=[completion_out]))
        return out

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

    saved = {k: getattr(vg, k, None) for k in ("is_vllm_available", "LLM", "VLLMClient", "SamplingParams")}
    vg.is_vllm_available, vg.LLM, vg.VLLMClient = (lambda *a, **k: True), RecordingLLM, RecordingClient
    vg.SamplingParams = SimpleNamespace  # vLLM's own takes the same keywords
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(vg, k, v)
