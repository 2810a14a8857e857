#!/usr/bin/env bash
# Execute notebooks/vram_report.ipynb on CUDA with the real model and write the executed
# notebook (outputs and plots inside) to $OUT/vram_report.ipynb, ready to commit over
# notebooks/vram_report.ipynb.
#
#   TINYLOOP_TEST_MODEL=/path/to/smollm2.tlm OUT=/tmp/out bash scripts/execute_notebook.sh
#
# The model: TINYLOOP_TEST_MODEL (a .tlm file; required: the committed report must come from
# the real model). Sizes: the notebook's own defaults (30 leak requests, 20 fragment requests)
# unless TINYLOOP_NB_* are set. The run's JSON/CSV/PNG/HTML files go to $OUT/vram_report_files.
# Needs nbformat, nbclient and ipykernel (the test extra). Exit status: the notebook's.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TINYLOOP_TEST_MODEL:?set TINYLOOP_TEST_MODEL to the .tlm path of the real model}"
[[ -f "$TINYLOOP_TEST_MODEL" ]] || { echo "no such model: $TINYLOOP_TEST_MODEL" >&2; exit 2; }
OUT=${OUT:-$PWD/notebook_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TINYLOOP_NB_MODEL="$TINYLOOP_TEST_MODEL"
export TINYLOOP_NB_BACKEND="${TINYLOOP_NB_BACKEND:-cuda}"
export TINYLOOP_NB_OUT="$OUT/vram_report_files"
python3 - "$OUT/vram_report.ipynb" <<'PY'
import sys, time
import nbclient, nbformat

dst = sys.argv[1]
nb = nbformat.read("notebooks/vram_report.ipynb", as_version=4)
for cell in nb.cells:                      # from scratch: no output of an older run survives
    if cell.cell_type == "code":
        cell.outputs, cell.execution_count = [], None
t0 = time.perf_counter()
try:
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": "."}}).execute()
finally:
    nbformat.write(nb, dst)                # partial outputs too: they show where it failed
images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
             for o in c.get("outputs", []))
print(f"executed in {time.perf_counter() - t0:.1f} s: {images} plots -> {dst}")
PY
