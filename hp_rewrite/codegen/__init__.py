"""libcst code generation: archetype templates specialised per matched class, written as artifacts."""

from .artifacts import Artifact, GeneratedFunction, import_artifact, write_artifact
from .specialize import specialize, template_path

__all__ = ["Artifact", "GeneratedFunction", "import_artifact", "specialize", "template_path", "write_artifact"]
