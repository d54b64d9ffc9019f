"""libcst code generation: archetype templates specialised per matched class (:mod:`.specialize`),
written as artifacts (:mod:`.artifacts`).

Importing the package does not import libcst: checking that an artifact is current (a cached
``apply``, every rank of a load) needs only :mod:`.artifacts`.
"""

from .artifacts import Artifact, GeneratedFunction, import_artifact, write_artifact

__all__ = ["Artifact", "GeneratedFunction", "import_artifact", "write_artifact"]
