"""Write, validate and import the generated code of one model.

An artifact directory holds ``modeling_ep.py`` (one forward per matched class), ``manifest.json``
(plan hash, config hash, hp-rewrite and transformers versions, a hash of each patched class's
source, the archetypes, a hash of a remote-code model's code files, a hash of the generated file)
and ``changes.diff`` (unified diff of every original forward against its generated replacement). The directory name carries a hash of the
manifest, so changing any input selects a new directory; an existing one is used only if its
manifest and file hash still match, and is regenerated otherwise. Everything is written into a
temporary directory first and renamed into place, so an interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..hf import remote_code_sha256, transformers_version

MODULE_FILE = "modeling_ep.py"
MANIFEST_FILE = "manifest.json"
DIFF_FILE = "changes.diff"
SUMMARY_FILE = "summary.json"  # what the analysis found (blocks, archetypes), for a cached apply to show


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def templates_hash() -> str:
    """A hash of every shipped template: generated code changes whenever one does, so the artifact
    key must too (a cached artifact from an older template would otherwise be reused)."""
    from importlib import resources

    folder = Path(str(resources.files("hp_rewrite.archetypes")))
    digest = hashlib.sha256()
    for f in sorted(folder.glob("*.py")):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def original_forward_source(cls: type) -> str:
    fn = cls.forward
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return f"# source of {cls.__qualname__}.forward is not available\n"


def class_source_hash(cls: type) -> str:
    """A hash of the file that defines ``cls`` (reading it is cheaper than finding the class in it, and
    a cached ``apply`` checks every patched class): any edit of that file regenerates the artifact."""
    try:
        data = Path(inspect.getsourcefile(cls)).read_bytes()
    except (OSError, TypeError):
        return sha256(cls.__module__ + "." + cls.__qualname__)
    return hashlib.sha256(cls.__qualname__.encode() + b"\0" + data).hexdigest()


def module_source_hash(name: str) -> str:
    """sha256 of a module's source file (an extension's archetype module, recorded in the manifest):
    found without importing the module itself, so a cached artifact can be checked cheaply."""
    path = getattr(sys.modules.get(name), "__file__", None)
    if path is None:
        try:
            spec = importlib.util.find_spec(name)
            path = spec.origin if spec is not None else None
        except (ImportError, ValueError):
            path = None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except (OSError, TypeError):
        return sha256(name)


def _sources_current(classes: dict) -> bool:
    """Whether every module an archetype recorded (``sources_sha256``: extensions) is unchanged."""
    return all(
        module_source_hash(name) == digest
        for entry in classes.values()
        for name, digest in (entry.get("archetype", {}).get("sources_sha256") or {}).items()
    )


@dataclass
class GeneratedFunction:
    cls: type
    function_name: str
    source: str
    archetype: dict


@dataclass
class Artifact:
    directory: Path
    manifest: dict

    @property
    def module_path(self) -> Path:
        return self.directory / MODULE_FILE

    @property
    def diff_path(self) -> Path:
        return self.directory / DIFF_FILE

    @property
    def files(self) -> list[str]:
        return [str(self.directory / f) for f in (MODULE_FILE, MANIFEST_FILE, DIFF_FILE)]

    @property
    def summary(self) -> dict | None:
        """What the analysis that generated this artifact found (None when not recorded)."""
        try:
            return json.loads((self.directory / SUMMARY_FILE).read_text())
        except (OSError, ValueError):
            return None

    def record_summary(self, summary: dict) -> None:
        """Keep ``summary`` beside the artifact (atomically; not part of its key)."""
        fd, tmp = tempfile.mkstemp(prefix=f".{SUMMARY_FILE}.", dir=self.directory)
        with os.fdopen(fd, "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
        os.replace(tmp, self.directory / SUMMARY_FILE)


def _module_text(functions: list[GeneratedFunction], header: dict) -> str:
    body = "\n\n\n".join(f.source.strip() for f in functions) + "\n"
    imports = "import torch\n\n" if "torch." in body else ""
    doc = (
        f'"""Expert-parallel forwards generated by hp-rewrite {header["hp_rewrite"]} '
        f'(transformers {header["transformers"]}).\n\n'
        f"Model type {header['model_type']}; plan {header['plan_hash'][:12]}; "
        f"config {header['config_hash'][:12]}.\nDo not edit: `hp-rewrite apply` regenerates this file "
        "whenever an input changes.\n\nReplaced forwards (the classes under the module names transformers "
        "gives them; a remote-code\nmodel's are in transformers_modules):\n"
        + "".join(f"    {f.function_name}: {f.cls.__module__}.{f.cls.__qualname__}.forward\n" for f in functions)
        + '"""\n\n'
    )
    return doc + imports + "from hp_rewrite import runtime as hp\n\n\n" + body


def _diff(functions: list[GeneratedFunction]) -> str:
    chunks = []
    for f in functions:
        old = original_forward_source(f.cls).splitlines(keepends=True)
        new = f.source.splitlines(keepends=True)
        name = f"{f.cls.__module__}.{f.cls.__qualname__}.forward"
        chunks.extend(difflib.unified_diff(old, new, fromfile=f"a/{name}", tofile=f"b/{MODULE_FILE}:{f.function_name}"))
    return "".join(chunks)


def build_manifest(functions: list[GeneratedFunction], plan_hash: str, config, model_type: str) -> dict:
    """What the artifact is generated from; a remote-code model's code files are hashed too
    (``remote_code_sha256``): an edit to any of them regenerates it."""
    remote = remote_code_sha256(config)
    return ({"remote_code_sha256": remote} if remote else {}) | {
        "hp_rewrite": __version__,
        "transformers": transformers_version(),
        "model_type": model_type,
        "templates_sha256": templates_hash(),
        "plan_hash": plan_hash,
        "config_hash": sha256(config.to_json_string(use_diff=False)),
        "classes": {
            f"{f.cls.__module__}.{f.cls.__qualname__}": {
                "function": f.function_name,
                "source_sha256": class_source_hash(f.cls),
                "archetype": f.archetype,
            }
            for f in functions
        },
    }


def _is_current(directory: Path, manifest: dict) -> bool:
    try:
        saved = json.loads((directory / MANIFEST_FILE).read_text())
        text = (directory / MODULE_FILE).read_text()
    except (OSError, ValueError):
        return False
    saved_file_hash = saved.pop("module_sha256", None)
    return saved == manifest and saved_file_hash == sha256(text) and (directory / DIFF_FILE).exists()


def _set_aside(directory: Path, manifest: dict) -> None:
    """Remove a stale artifact directory without pulling it from under another process: rename it aside
    whole, then delete it; one that turns out current (another writer replaced it since we looked) is put
    back. A directory only ever appears or disappears whole."""
    aside = Path(tempfile.mkdtemp(prefix=f".{directory.name}.stale.", dir=directory.parent))
    try:
        os.replace(directory, aside / "old")
        if _is_current(aside / "old", manifest):
            os.replace(aside / "old", directory)
    except OSError:  # another writer set it aside, or put a current one back, first
        pass
    shutil.rmtree(aside, ignore_errors=True)


def write_artifact(functions: list[GeneratedFunction], plan_hash: str, config, model_type: str,
                   out_dir: Path) -> Artifact:
    """Generate (or reuse, when current) the artifact directory under ``out_dir``.

    Safe for several writers at once (two jobs on one machine, every node's rank 0 on a shared home
    directory): they write the same bytes, each in a temporary directory renamed into place, and a stale
    directory is set aside whole (:func:`_set_aside`), so no process reads a directory half-written or
    half-deleted."""
    manifest = build_manifest(functions, plan_hash, config, model_type)
    key = sha256(json.dumps(manifest, sort_keys=True))[:16]
    directory = Path(out_dir) / f"{model_type}-{key}"
    if _is_current(directory, manifest):
        return Artifact(directory, manifest)
    text = _module_text(functions, manifest)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=out_dir))
    try:
        (tmp / MODULE_FILE).write_text(text)
        (tmp / DIFF_FILE).write_text(_diff(functions))
        (tmp / MANIFEST_FILE).write_text(json.dumps({**manifest, "module_sha256": sha256(text)}, indent=2, sort_keys=True))
        if directory.exists() and not _is_current(directory, manifest):  # stale, and not just rewritten
            _set_aside(directory, manifest)
        try:
            os.replace(tmp, directory)
        except OSError:  # another writer put the same (deterministic) artifact there first
            if not _is_current(directory, manifest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Artifact(directory, manifest)


def import_artifact(artifact: Artifact):
    """Import ``modeling_ep.py`` from its file, so tracebacks and inspect.getsource show real lines.

    The module is registered in ``sys.modules`` under its name: torch.compile (dynamo) and pickle
    look functions up by ``__module__``. The name carries the artifact's content hash, so one name
    is always the same code; a second import of it reuses the first.
    """
    name = f"hp_rewrite_generated_{artifact.directory.name.replace('-', '_').replace('.', '_')}"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")) == artifact.module_path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, artifact.module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _class_by_qualname(qualname: str) -> type | None:
    module_name, _, cls_name = qualname.rpartition(".")
    try:
        obj = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(obj, cls_name, None)


def find_current(out_dir: Path, plan_hash: str, config) -> Artifact | None:
    """An existing artifact generated from these inputs, still valid, without re-running the analysis.

    Valid means: same plan and config hashes and versions, every patched class's source unchanged,
    and the generated file untouched. Lets a rank load with the artifact ``apply`` (or rank 0) wrote.
    """
    config_hash = sha256(config.to_json_string(use_diff=False))
    for manifest_path in sorted(Path(out_dir).glob(f"{config.model_type}-*/{MANIFEST_FILE}")):
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            continue
        manifest.pop("module_sha256", None)
        if (manifest.get("plan_hash"), manifest.get("config_hash")) != (plan_hash, config_hash):
            continue
        if (manifest.get("hp_rewrite"), manifest.get("transformers")) != (__version__, transformers_version()):
            continue
        if manifest.get("templates_sha256") != templates_hash():
            continue
        if manifest.get("remote_code_sha256") != remote_code_sha256(config):
            continue
        classes_ok = all(
            (cls := _class_by_qualname(q)) is not None and class_source_hash(cls) == entry["source_sha256"]
            for q, entry in manifest.get("classes", {}).items()
        )
        sources_ok = _sources_current(manifest.get("classes", {}))  # extensions' archetype modules
        if classes_ok and sources_ok and _is_current(manifest_path.parent, manifest):
            return Artifact(manifest_path.parent, manifest)
    return None
