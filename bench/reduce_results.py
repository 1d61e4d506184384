"""`python -m bench.reduce_results`: reduce every raw report in ``bench/results/`` to the
summary ``--summary`` writes today, in place (run once for issue 53; the raw reports stay in
the git history, and each summary names the commit that still holds its report)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.report import git_commit
from bench.summary import SUMMARY_LIMIT, summarize, summary_text

RESULTS = Path(__file__).resolve().parent / "results"


def reduce_file(path: Path, commit: str) -> bool:
    """Rewrite ``path`` as its summary; False when it is one already."""
    if path.stat().st_size <= SUMMARY_LIMIT:
        return False
    report = json.loads(path.read_text())
    trace = f"git show {commit}:bench/results/{path.name}"
    path.write_text(summary_text(summarize(report, {"trace": trace})))
    return True


def main(argv: list[str] | None = None) -> int:
    folder = Path(argv[0]) if argv else RESULTS
    commit = git_commit(folder).removesuffix("-dirty")
    done = [p.name for p in sorted(folder.glob("*.json")) if reduce_file(p, commit)]
    print(f"reduced {len(done)} reports in {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
