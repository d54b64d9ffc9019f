"""Context parallelism of a decoder's sequence (plan ``cp_size``), beside tensor parallelism.

:func:`install_context` splits each sequence over the context group after the embeddings and gathers it
back after the decoder (:mod:`.shard`, with the gradient convention that makes a context rank one more
data-parallel rank to everything else); attention exchanges heads for sequence (:mod:`.ulysses`). The
MoE blocks see this rank's share of the tokens and exchange them over the EP group as any rank's.
"""

from .errors import ContextParallelError
from .install import ContextSplit, install_context

__all__ = ["ContextParallelError", "ContextSplit", "install_context"]
