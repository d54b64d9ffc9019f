"""Regenerate the golden generated forwards of tests/test_codegen_golden.py (tests/golden/*.py.golden):

    python tools/update_golden.py

Run it after a deliberate change to an archetype template or to the generator, then read the diff:
it is the change every user's generated code will see.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_codegen_golden import CASES, GOLDEN, generated  # noqa: E402


def main() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name, (model_type, archetype) in CASES.items():
        (GOLDEN / f"{name}.py.golden").write_text(generated(model_type, archetype))
        print(f"wrote {GOLDEN / f'{name}.py.golden'}")


if __name__ == "__main__":
    main()
