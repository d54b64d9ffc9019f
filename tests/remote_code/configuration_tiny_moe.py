"""Configuration of a remote-code MoE model written the way Hub trust_remote_code repos are (test asset)."""

from transformers import PretrainedConfig


class TinyMoeConfig(PretrainedConfig):
    """``router``: ``softmax`` (top-k, renormalised), ``softmax_gated_shared`` (top-k with a sigmoid-gated
    shared expert), ``sigmoid_group`` (grouped sigmoid scores with a correction bias and an additive
    shared expert) or ``softmax_temperature`` (softmax of logits / 0.7: no built-in router kind)."""

    model_type = "tiny_remote_moe"

    def __init__(self, vocab_size=64, hidden_size=16, intermediate_size=12, num_hidden_layers=2,
                 num_experts=4, num_experts_per_tok=2, router="softmax", n_group=2, topk_group=1,
                 routed_scaling_factor=1.0, rms_norm_eps=1e-6, tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.router = router
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.rms_norm_eps = rms_norm_eps
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
