"""A remote-code MoE causal LM in the style of the Hub's trust_remote_code repos (test asset): experts an
``nn.ModuleList`` of per-expert MLPs with their own ``Linear`` weights, a router ``Linear`` and the
softmax / top-k written inline in the block's forward, as Mixtral's and Qwen1.5-MoE's original code."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_tiny_moe import TinyMoeConfig


class TinyMoeRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


class TinyMoeMLP(nn.Module):
    def __init__(self, config, intermediate_size=None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.w1 = nn.Linear(config.hidden_size, inter, bias=False)
        self.w3 = nn.Linear(config.hidden_size, inter, bias=False)
        self.w2 = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TinyMoeSparseBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList([TinyMoeMLP(config) for _ in range(config.num_experts)])
        if config.router == "softmax_gated_shared":
            self.shared_expert = TinyMoeMLP(config, 2 * config.intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        elif config.router == "sigmoid_group":
            self.shared_experts = TinyMoeMLP(config)
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))

    def route(self, hidden):
        logits = self.gate(hidden)
        if self.config.router == "softmax_temperature":  # no built-in router kind: the block stays unmatched
            logits = logits / 0.7
        if self.config.router != "sigmoid_group":
            probs = F.softmax(logits, dim=-1, dtype=torch.float)
            weights, selected = torch.topk(probs, self.top_k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights.to(hidden.dtype), selected
        scores = F.linear(hidden.float(), self.gate.weight.float()).sigmoid()  # DeepSeek's fp32 router
        biased = scores + self.e_score_correction_bias
        groups = biased.view(-1, self.config.n_group, self.num_experts // self.config.n_group)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.config.topk_group, dim=-1)[1], 1)
        mask = keep.unsqueeze(-1).expand_as(groups).reshape(-1, self.num_experts)
        selected = biased.masked_fill(mask == 0, 0.0).topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, selected)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.config.routed_scaling_factor
        return weights.to(hidden.dtype), selected

    def forward(self, hidden_states):
        batch, seq, dim = hidden_states.shape
        hidden = hidden_states.view(-1, dim)
        weights, selected = self.route(hidden)
        out = torch.zeros_like(hidden)
        expert_mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            slot, token = torch.where(expert_mask[e])
            if token.numel() == 0:
                continue
            y = self.experts[e](hidden[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(hidden.dtype))
        if self.config.router == "softmax_gated_shared":
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        elif self.config.router == "sigmoid_group":
            out = out + self.shared_experts(hidden)
        return out.view(batch, seq, dim)


class TinyMoeLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = TinyMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.post_norm = TinyMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = TinyMoeSparseBlock(config)

    def forward(self, x):
        # a causal token mixer (running mean over earlier positions) stands in for attention
        h = self.norm(x)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=h.dtype)[None, :, None]
        x = x + self.mixer(h.cumsum(1) / steps)
        return x + self.mlp(self.post_norm(x))


class TinyMoePreTrainedModel(PreTrainedModel):
    config_class = TinyMoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["TinyMoeLayer"]

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.2)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=1.0)
        elif isinstance(module, TinyMoeRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, TinyMoeSparseBlock) and hasattr(module, "e_score_correction_bias"):
            nn.init.zeros_(module.e_score_correction_bias)


class TinyMoeModel(TinyMoePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([TinyMoeLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = TinyMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TinyMoeForCausalLM(TinyMoePreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = TinyMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)
