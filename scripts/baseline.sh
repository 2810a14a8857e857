#!/usr/bin/env bash
# Write .baseline/: tinyloop/, cuda_src/ (where the tree has it) and benchmarks/ of git revision REV,
# for scripts/device_run.sh's BASELINE=1 A/B decode benchmark in the same device call.
#   usage: scripts/baseline.sh REV        (remove .baseline/ afterwards; it is untracked)
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/baseline.sh REV}
rm -rf .baseline && mkdir .baseline
paths=(tinyloop benchmarks)
git cat-file -e "$rev:cuda_src" 2>/dev/null && paths+=(cuda_src)
git archive "$rev" "${paths[@]}" | tar -x -C .baseline
echo "baseline $(git rev-parse --short "$rev") in .baseline ($(du -sh .baseline | cut -f1))"
