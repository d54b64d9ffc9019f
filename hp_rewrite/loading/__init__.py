"""Loading and making models: tiny random-weight models built from transformers configs.

See :mod:`hp_rewrite.loading.tiny`.
"""

from .local import CheckpointKeyError, load_expert_parallel
from .tiny import (
    FAMILY_DEFAULTS,
    KEEP_OFF,
    SHRINK_RULES,
    TEXT_TOKEN_LIMIT,
    TinyError,
    TypeSurvey,
    auto_class_for,
    build_tiny_model,
    experts_holders,
    make_tiny,
    moe_model_types,
    randomise_routers,
    sample_input_ids,
    survey_model_types,
    tiny_config,
)

__all__ = [
    "CheckpointKeyError",
    "load_expert_parallel",
    "FAMILY_DEFAULTS",
    "KEEP_OFF",
    "SHRINK_RULES",
    "TEXT_TOKEN_LIMIT",
    "TinyError",
    "TypeSurvey",
    "auto_class_for",
    "build_tiny_model",
    "experts_holders",
    "make_tiny",
    "moe_model_types",
    "randomise_routers",
    "sample_input_ids",
    "survey_model_types",
    "tiny_config",
]
