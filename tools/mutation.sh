#!/usr/bin/env bash
# Mutation testing of the core modules against the fast tests (no Celery worker; the in-process
# ship test needs the Redis at REDIS_URL):
# the modules and tests are listed under [tool.mutmut] in pyproject.toml. Slow (tens of
# minutes on two cores), so not part of CI; see TESTING.md.
#   tools/mutation.sh                          every core module
#   tools/mutation.sh 'tasks.stages.encode*'   only mutants whose names match (fnmatch globs)
# Writes the report (kill rate per module, every mutant not killed with its diff) to
# ${MUTATION_REPORT:-mutants/report.md}. Parallel mutants: MUTATION_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import mutmut" 2>/dev/null; then
  echo "mutation: mutmut is not installed; run: pip install -e '.[mutation]'" >&2
  exit 2
fi
mutmut run --max-children "${MUTATION_JOBS:-2}" "$@"
report="${MUTATION_REPORT:-mutants/report.md}"
python tools/mutation_report.py >"$report"
sed -n '1,/^Kill rate/p' "$report"
echo "mutation: report written to $report"
