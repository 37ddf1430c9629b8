"""Summarize a mutmut run: per module the mutants killed and not, the kill rate, and the diff
of every mutant no fast test killed. Reads mutmut's results under `mutants/`; run from the
repository root after `mutmut run` (tools/mutation.sh does both)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

# mutmut's exit codes (mutmut/models/stats.py); everything else is "suspicious".
KILLED = {1: "killed", 3: "killed", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout"}
NOT_KILLED = {0: "survived", 5: "no tests", 33: "no tests", None: "not checked"}
COLUMNS = ("mutants", "killed", "survived", "no tests", "other")


def status(exit_code: int | None) -> str:
    return KILLED.get(exit_code) or NOT_KILLED.get(exit_code) or "suspicious"  # type: ignore[arg-type]


def mutant_diff(name: str, path: str) -> str:
    """The mutant's diff from mutmut itself (an internal API: the name alone if it moved)."""
    try:
        from mutmut.mutation.diff_apply import get_diff_for_mutant

        return get_diff_for_mutant(name, path=path).rstrip()
    except Exception as exc:  # a newer mutmut may have moved it; the report still lists the name
        return f"(no diff: {type(exc).__name__})"


def tally(codes: dict[str, int]) -> Counter[str]:
    counts = Counter(status(c) for c in codes.values())
    killed = counts["killed"] + counts["timeout"]
    other = len(codes) - killed - counts["survived"] - counts["no tests"]
    return Counter({"mutants": len(codes), "killed": killed, "survived": counts["survived"],
                    "no tests": counts["no tests"], "other": other})  # fmt: skip


def row(name: str, counts: Counter[str]) -> str:
    cells = " | ".join(str(counts[c]) for c in COLUMNS)
    return f"| {name} | {cells} | {counts['killed'] / counts['mutants']:.1%} |"


def main(root: Path = Path("mutants")) -> int:
    results = {}
    for meta in sorted(root.rglob("*.py.meta")):
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        tried = {k: v for k, v in codes.items() if v is not None}
        if tried:
            results[str(meta.relative_to(root))[: -len(".meta")]] = tried
    if not results:
        print("mutation: no results under mutants/; run tools/mutation.sh first", file=sys.stderr)
        return 1
    print("# Mutation report\n")
    print(f"| module | {' | '.join(COLUMNS)} | kill rate |")
    print("|---" + "|---:" * (len(COLUMNS) + 1) + "|")
    total: Counter[str] = Counter()
    for path, codes in results.items():
        counts = tally(codes)
        total.update(counts)
        print(row(path, counts))
    print(row("**all**", total))
    print("\nKill rate = (killed + timeout) / mutants tried; 'no tests' counts against it.")
    for path, codes in results.items():
        alive = [k for k, c in codes.items() if status(c) not in ("killed", "timeout")]
        if alive:
            print(f"\n## {path}: {len(alive)} not killed\n")
            for name in alive:
                print(f"### {name} ({status(codes[name])})\n\n```diff\n{mutant_diff(name, path)}\n```\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
