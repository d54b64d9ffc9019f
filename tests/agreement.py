"""How the suite compares what two programs computed (the rewritten model and the unmodified one, EP and
not, sharded and not): floats to a stated tolerance, never ``==``, since two programs that add in
different orders round differently, and by how much depends on the CPU's kernels (AVX-512, AVX2, the
scalar ones under ``ATEN_CPU_CAPABILITY=default``). What must be exact stays exact: counts, lengths,
names, token ids. Bit-for-bit comparisons are for one program computing the same thing twice (a resume,
a reload, a cached artifact)."""

from __future__ import annotations

import math

LOGGED_REL = 1e-5  # a logged fp32 scalar of two programs: a few roundings apart (measured 8.6e-8)
# a logged value that is zero in exact arithmetic (GRPO's loss on a step whose advantages sum to zero)
# is the rounding noise of O(1) terms: below this, two values agree whatever their ratio
LOGGED_ABS = 1e-6
# entries that count things (tokens, completions' lengths, steps): the same in any program that
# computes what it should, so compared exactly
EXACT_PREFIXES = ("completions/", "num_tokens", "epoch", "step")


def _agree(key: str, mine, theirs, rel: float) -> bool:
    if key.startswith(EXACT_PREFIXES) or not isinstance(mine, float) or not isinstance(theirs, float):
        return type(mine) is type(theirs) and mine == theirs
    if math.isnan(mine) or math.isnan(theirs):
        return math.isnan(mine) and math.isnan(theirs)
    return math.isclose(mine, theirs, rel_tol=rel, abs_tol=LOGGED_ABS)


def logs_disagree(mine: list[dict], theirs: list[dict], rel: float = LOGGED_REL) -> list[str]:
    """Where two trainer log histories differ: entry count, keys, and each value (floats to ``rel``,
    everything else exactly). Empty when they agree."""
    if len(mine) != len(theirs):
        return [f"{len(mine)} log entries against {len(theirs)}"]
    out = []
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        if a.keys() != b.keys():
            out.append(f"entry {i}: keys {sorted(a.keys() ^ b.keys())} in one only")
            continue
        out.extend(f"entry {i}: {k} {a[k]!r} against {b[k]!r}" for k in a if not _agree(k, a[k], b[k], rel))
    return out


def assert_logs_agree(mine: list[dict], theirs: list[dict], rel: float = LOGGED_REL, context=None) -> None:
    """Two programs' trainer logs agree: the same entries and keys, counts exact, floats within ``rel``."""
    wrong = logs_disagree(mine, theirs, rel)
    assert not wrong, (context, wrong, mine, theirs)
