"""hp-rewrite: expert-parallel rewriting of transformers Mixture-of-Experts models.

The routed runtime lives in :mod:`hp_rewrite.runtime`; everything the generated code calls is
exported from there.
"""

__version__ = "0.1.0"
