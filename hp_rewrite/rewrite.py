"""The pipeline in three calls, for scripts and tests: ``analyze`` a model under a plan, ``write`` (or
``generate``) the artifact, ``install`` it on a model with real weights.

The steps live in their layers (:mod:`hp_rewrite.match.analysis`, :mod:`hp_rewrite.match.generate`,
:mod:`hp_rewrite.loading.install`); this module only gathers them, and nothing in the package imports it.
"""

from .loading.install import install
from .match.analysis import Analysis, AnalysisFailure, analyze, expert_placement, recorded_router_classes
from .match.generate import ensure_artifact, generate, generated_functions, write

__all__ = ["Analysis", "AnalysisFailure", "analyze", "ensure_artifact", "expert_placement", "generate",
           "generated_functions", "install", "recorded_router_classes", "write"]
