"""The plan schema: frozen pydantic models, one per YAML section.

Validation is strict (no "2" -> 2, no 1 -> true) because a plan decides how a model is sharded:
a silently coerced typo would produce a different, still-running program. Every model forbids
unknown keys for the same reason. Turning pydantic errors into readable messages with YAML line
numbers is the loader's job (:mod:`hp_rewrite.plan.loader`).
"""

from __future__ import annotations

import hashlib
import json
import keyword
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import UserError

if TYPE_CHECKING:
    from hp_rewrite.runtime.options import RuntimeOptions

PLAN_VERSION = 1

RouterKind = Literal["auto", "softmax_topk", "sigmoid_group", "topk_router_module"]
SharedKind = Literal["auto", "none", "additive", "gated", "scaled"]
LevelKind = Literal["auto", "block", "experts"]
ComputeKind = Literal["auto", "grouped", "eager", "npu", "batched"]
DropPolicy = Literal["probs", "position"]
BalanceKind = Literal["off", "auto"]
RouterDtype = Literal["auto", "fp32", "logits"]
PlacementStrategy = Literal["contiguous", "balanced"]
AuxLossKind = Literal["micro_batch", "global"]
ContextScheme = Literal["ulysses"]
ContextLogits = Literal["whole", "local"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a plan; ``line`` is 1-based, None when the plan did not come from text."""

    source: str
    line: int | None
    path: str
    message: str

    def __str__(self) -> str:
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        return f"{where}: {self.path}: {self.message}" if self.path else f"{where}: {self.message}"


class PlanError(UserError, ValueError):
    """A plan that cannot be used. ``problems`` lists every fault found, ordered by line."""

    def __init__(self, problems: list[Problem] | tuple[Problem, ...]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _check_glob(glob: str) -> str:
    if not glob.strip():
        raise ValueError("a glob must not be empty; use '*' to match everything")
    if glob != glob.strip():
        raise ValueError(f"glob {glob!r} has leading or trailing whitespace, which never matches")
    return glob


Glob = Annotated[str, AfterValidator(_check_glob)]


class ModulesSection(_Section):
    """Which MoE blocks to rewrite: fnmatch globs over module paths or class names."""

    include: list[Glob] = Field(default_factory=lambda: ["*"], min_length=1)
    exclude: list[Glob] = Field(default_factory=list)

    def matches(self, path: str, class_name: str) -> bool:
        """True when an include glob matches the path or the class name and no exclude glob does."""

        def hit(globs: list[str]) -> bool:
            return any(fnmatchcase(path, g) or fnmatchcase(class_name, g) for g in globs)

        return hit(self.include) and not hit(self.exclude)


class ArchetypeSection(_Section):
    """How a matched block is rewritten; ``auto`` lets the matcher decide from the module structure."""

    router: RouterKind = "auto"
    shared: SharedKind = "auto"
    level: LevelKind = "auto"

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, data: Any) -> Any:
        # `archetype: auto` is shorthand for all three fields auto.
        if isinstance(data, str):
            if data == "auto":
                return {}
            raise ValueError(
                f"{data!r}: as a string only 'auto' is allowed; otherwise write a mapping "
                "with router, shared, level"
            )
        return data


class RuntimeSection(_Section):
    """Knobs of the routed runtime (see :class:`hp_rewrite.runtime.options.RuntimeOptions`) plus collectives."""

    compute: ComputeKind = "auto"
    chunks: int = Field(1, ge=1)
    overlap: bool = True
    capacity_factor: float | None = Field(None, gt=0, allow_inf_nan=False)
    drop_policy: DropPolicy = "probs"
    renormalize_kept: bool = False
    dedup: bool = True
    defer_expert_grads: bool = False
    router_dtype: RouterDtype = "auto"
    timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    grad_bucket_mb: float = Field(25.0, gt=0, allow_inf_nan=False)
    dequant_chunk_mb: float = Field(64.0, gt=0, allow_inf_nan=False)
    fp8_gemm: bool = False
    weight_sync_bucket_mb: float = Field(512.0, gt=0, allow_inf_nan=False)
    balance: BalanceKind = "off"
    balance_threshold: float = Field(1.1, ge=1, allow_inf_nan=False)
    balance_min_rows: int = Field(1024, ge=1)
    balance_replicas: int = Field(2, ge=1)

    @field_validator("balance", mode="before")
    @classmethod
    def _balance_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false: `balance: off` (what the docs and errors say) means "off"
        return "off" if value is False else value

    def to_options(self) -> RuntimeOptions:
        """The runtime's options; imported lazily so reading a plan never imports torch."""
        from hp_rewrite.runtime.options import RuntimeOptions

        return RuntimeOptions(
            compute=self.compute,
            chunks=self.chunks,
            overlap=self.overlap,
            capacity_factor=self.capacity_factor,
            drop_policy=self.drop_policy,
            renormalize_kept=self.renormalize_kept,
            dedup=self.dedup,
            defer_expert_grads=self.defer_expert_grads,
            dequant_chunk_mb=self.dequant_chunk_mb,
            fp8_gemm=self.fp8_gemm,
            balance=self.balance,
            balance_threshold=self.balance_threshold,
            balance_min_rows=self.balance_min_rows,
            balance_replicas=self.balance_replicas,
        )


class RoutingSection(_Section):
    """Routing health and control in training (docs/training.md, "Routing").

    ``stats``: count what the routers choose in every training forward (on the device, no host sync),
    reduce the counts over the world once per optimizer step, and log them (``moe/`` keys) where a
    prepared Trainer, TRL trainer or accelerate run logs; ``hp_rewrite.routing_stats(model)`` reads them.
    ``bias_update_rate``: after every optimizer step, each router's selection bias moves by this much
    toward even load (DeepSeek-V3's auxiliary-loss-free balancing); 0 = never, as transformers.
    ``freeze_router``: the routers' weights and biases get no gradient and no optimizer state.
    ``replay_in_recompute``: activation checkpointing's recomputation reuses the experts its forward chose.
    ``aux_loss``: the load-balancing loss on each rank's micro-batch (``micro_batch``, transformers') or on
    the global batch of every data-parallel rank (``global``).
    ``z_loss_coef``: adds this times the router z-loss (ST-MoE) to the loss, on the batch ``aux_loss`` says.
    ``replay_rollout``: a prepared GRPOTrainer (TRL, vLLM colocated, built inside
    ``hp_rewrite.vllm_returns_routes()``) replays in its training forwards the experts vLLM chose while
    rolling out (R3); off, as TRL: the training forwards route afresh.
    """

    stats: bool = True
    bias_update_rate: float = Field(0.0, ge=0, allow_inf_nan=False)
    freeze_router: bool = False
    replay_in_recompute: bool = True
    aux_loss: AuxLossKind = "micro_batch"
    z_loss_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    replay_rollout: bool = False


class PlacementSection(_Section):
    """Which EP rank holds which experts.

    ``contiguous``: rank r holds the r-th block of ``E / ep_size`` consecutive experts. ``balanced``: per
    MoE block, the experts are spread so every rank receives about the same routed load, measured on
    real data (a rank with popular experts makes the others wait in every all-to-all). The loads
    come from ``profile``, the JSON ``hp-rewrite profile`` writes (a path relative to the plan file),
    or are written inline as ``loads: {block path: [tokens per expert]}``; either way the loads
    themselves are part of the plan and of its hash. Placement never changes results, only speed.
    """

    strategy: PlacementStrategy = "contiguous"
    profile: str | None = None
    loads: dict[str, list[Annotated[int, Field(ge=0)]]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> PlacementSection:
        if self.strategy == "contiguous" and (self.profile is not None or self.loads):
            raise ValueError("profile and loads are only used with strategy: balanced")
        if self.strategy == "balanced" and not self.loads:
            raise ValueError(
                "strategy: balanced needs the routing loads: set profile: to the JSON file "
                "`hp-rewrite profile` writes, or write loads: {block path: [tokens per expert]}"
            )
        for path, counts in self.loads.items():
            if not counts:
                raise ValueError(f"loads[{path!r}] is empty; give one count per expert")
        return self

    def loads_for(self, path: str) -> list[int] | None:
        """Per-expert loads of the block at ``path`` (None when the placement is contiguous)."""
        if self.strategy == "contiguous":
            return None
        return self.loads.get(path)


class ContextSection(_Section):
    """How a context-parallel model (plan ``cp_size > 1``) splits its attention over the context group.

    ``scheme``: ``ulysses`` (DeepSpeed-Ulysses): every layer but attention holds this rank's share of the
    sequence; attention exchanges heads for sequence with two all-to-alls, runs over the whole sequence with
    ``heads / cp_size`` heads, and exchanges back. The only scheme so far (ring attention may follow).

    ``logits``: ``whole`` (transformers' output: the decoder's output is gathered, every rank computes the
    head over the whole sequence) or ``local`` (the head runs on this rank's positions and returns their
    logits only; the loss is still the whole sequence's, summed over the group).
    """

    scheme: ContextScheme = "ulysses"
    logits: ContextLogits = "whole"


class OutputSection(_Section):
    """Where generated code goes; None defers to the CLI's ``--out`` or its default."""

    dir: str | None = None

    @field_validator("dir")
    @classmethod
    def _non_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty; omit it (or write null) to use the CLI's --out")
        return value


def _check_module_name(name: str) -> str:
    parts = name.split(".")
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise ValueError(f"{name!r} is not a dotted Python module name (like my_pkg.archetypes)")
    return name


ModuleName = Annotated[str, AfterValidator(_check_module_name)]
_SECTIONS = ("modules", "archetype", "runtime", "routing", "placement", "context", "output", "extensions")


class Plan(_Section):
    """A versioned expert-parallel plan. Build it with :func:`load_plan` / :func:`parse_plan`."""

    version: int
    ep_size: int = Field(ge=1)
    # tensor parallelism of the dense parts over groups of tp_size consecutive ranks (the ranks of one
    # TP group share one batch); sequence_parallel shards the residual stream and its norms on the sequence
    tp_size: int = Field(1, ge=1)
    sequence_parallel: bool = False
    # context parallelism over groups of cp_size consecutive ranks (the ranks of one context group share one
    # batch, each holds its share of every sequence; the scheme is the context section's)
    cp_size: int = Field(1, ge=1)
    modules: ModulesSection = Field(default_factory=ModulesSection)
    archetype: ArchetypeSection = Field(default_factory=ArchetypeSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    routing: RoutingSection = Field(default_factory=RoutingSection)
    placement: PlacementSection = Field(default_factory=PlacementSection)
    context: ContextSection = Field(default_factory=ContextSection)
    output: OutputSection = Field(default_factory=OutputSection)
    # Dotted module names the rewriter imports so they can register archetypes. Only validated
    # here: the plan layer never imports anything.
    extensions: list[ModuleName] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _null_sections(cls, data: Any) -> Any:
        # `runtime:` with every knob commented out is YAML null: read it as "all defaults".
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in _SECTIONS and v is None)}
        return data

    @model_validator(mode="after")
    def _parallel_sizes(self) -> Plan:
        if self.sequence_parallel and self.tp_size == 1:
            raise ValueError("sequence_parallel: true needs tp_size > 1 (the sequence is split over the TP group)")
        small, large = sorted((self.ep_size, self.tp_size))
        if large % small:
            raise ValueError(
                f"ep_size {self.ep_size} and tp_size {self.tp_size}: one must divide the other (an EP group "
                "spans whole TP groups, or a TP group whole EP groups)"
            )
        if self.tp_size > 1 and self.runtime.capacity_factor is not None:
            raise ValueError("runtime.capacity_factor with tp_size > 1 is not supported: drop one of them")
        self._context_composes()
        return self

    def _context_composes(self) -> None:
        """What context parallelism does not compose with yet, refused by field."""
        if self.cp_size == 1:
            if self.context.logits != "whole":
                raise ValueError("context.logits: local needs cp_size > 1 (the logits of a context rank's share)")
            return
        refused = [("sequence_parallel: true", self.sequence_parallel, "sequence_parallel: false"),
                   ("runtime.capacity_factor", self.runtime.capacity_factor is not None,
                    "capacity_factor: null (capacity would be decided on each rank's share of a sequence)"),
                   ("routing.aux_loss: global", self.routing.aux_loss == "global", "aux_loss: micro_batch"),
                   ("routing.z_loss_coef", self.routing.z_loss_coef > 0, "z_loss_coef: 0"),
                   ("routing.replay_rollout: true", self.routing.replay_rollout, "replay_rollout: false")]
        for what, on, fix in refused:
            if on:
                raise ValueError(f"cp_size {self.cp_size} with {what} is not supported yet: set {fix}, or cp_size: 1")

    @field_validator("version")
    @classmethod
    def _version(cls, value: int) -> int:
        if value != PLAN_VERSION:
            raise ValueError(
                f"unsupported plan version {value}; this hp-rewrite reads version {PLAN_VERSION}"
            )
        return value

    def matches(self, path: str, class_name: str) -> bool:
        """Whether the MoE block at ``path`` (of class ``class_name``) is rewritten by this plan."""
        return self.modules.matches(path, class_name)

    def canonical(self) -> dict[str, Any]:
        """Every field with its defaults filled in, keys sorted: the input of :meth:`hash`."""
        return _sorted(self.model_dump(mode="json"))

    def hash(self) -> str:
        """sha256 of the canonical JSON; independent of YAML formatting and key order."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted(v) for v in value]
    return value


DEFAULT_PLAN = Plan(version=PLAN_VERSION, ep_size=1)
