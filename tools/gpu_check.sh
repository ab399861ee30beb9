#!/usr/bin/env bash
# The one prepared script for the GPU machine (see shared/GPU_MACHINE.md): it has python3 3.12
# with a CUDA build of torch and no network. Beforehand, here: bash tools/fetch_gpu_wheels.sh
# (fills .gpu_wheels/, which must travel along with the working tree).
#
#   bash tools/gpu_check.sh        # logs, junit.xml and summary.json in ${OUT:-out/gpu_check}
#
# It installs no torch. The wheels go into a scratch folder on PYTHONPATH (each one the machine
# does not already have; megatron-core and megatron-energon always, at our pinned versions),
# beside the repo and patches/ as megatron_mllm_patches. Then the tests marked gpu run as under
# `make gpu-check` (MEGATRON_MLLM_GPU_CHECK=1: nothing skips; a missing GPU is a failure), except
# that tests needing more GPUs than are present are deselected and named in the log
# (GPU_CHECK_ALL=1 runs them, and they fail). The whole run ends within about 6 minutes.
#
# Environment: OUT, SCRATCH (default: a fresh temporary folder), WHEELS (default .gpu_wheels),
# PYTHON (default python3), GPU_CHECK_TIMEOUT_S (pytest's limit, default 300), GPU_CHECK_ALL.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
REPO="$(pwd)"
OUT="${OUT:-out/gpu_check}"
WHEELS="${WHEELS:-.gpu_wheels}"
PYTHON="${PYTHON:-python3}"
TIMEOUT_S="${GPU_CHECK_TIMEOUT_S:-300}"
SCRATCH="${SCRATCH:-$(mktemp -d "${TMPDIR:-/tmp}/megatron_mllm_gpu.XXXXXX")}"
START=$(date +%s)
mkdir -p "$OUT" "$SCRATCH"
LOG="$OUT/gpu_check.log"
: >"$LOG"

say() { echo "gpu_check: $*" | tee -a "$LOG"; }
die() {
	say "$*"
	exit 1
}

# 1. What the machine is.
{
	echo "date: $(date -u +%FT%TZ)"
	echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
	if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1; else echo "nvidia-smi: not found"; fi
	"$PYTHON" - <<'EOF' 2>&1
import platform, sys
print("python:", sys.version.split()[0], platform.machine())
try:
    import torch
    print("torch:", torch.__version__, "cuda:", torch.version.cuda,
          "available:", torch.cuda.is_available(), "devices:", torch.cuda.device_count())
    for i in range(torch.cuda.device_count()):
        print(f"  cuda:{i}", torch.cuda.get_device_name(i))
except Exception as err:  # noqa: BLE001
    print("torch: not importable:", err)
EOF
} | tee "$OUT/env.txt" | tee -a "$LOG"

# 2. The wheels, into the scratch folder (no index, no dependency resolution: the list is ours).
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
((${#wheels[@]})) || die "no wheels in $WHEELS; run bash tools/fetch_gpu_wheels.sh where there is a network first"
"$PYTHON" - "${wheels[@]}" >"$SCRATCH/todo.txt" 2>>"$LOG" <<'EOF'
import importlib.metadata as md
import os
import re
import sys

ALWAYS = {"megatron-core", "megatron-energon"}  # pinned: ours even where the machine has one
for path in sys.argv[1:]:
    name = re.sub(r"[-_.]+", "-", os.path.basename(path).split("-")[0]).lower()
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is None or name in ALWAYS:
        print(path)
    else:
        print(f"the machine's {name} {have} is used", file=sys.stderr)
EOF
mapfile -t todo <"$SCRATCH/todo.txt"
say "installing ${#todo[@]} of ${#wheels[@]} wheels into $SCRATCH"
if ((${#todo[@]})); then
	if "$PYTHON" -m pip --version >/dev/null 2>&1; then
		"$PYTHON" -m pip install --quiet --no-index --no-deps --disable-pip-version-check \
			--no-warn-script-location --target "$SCRATCH" "${todo[@]}" >>"$LOG" 2>&1 ||
			die "pip install of the wheels failed; see $LOG"
	else # a wheel is a zip archive: unpacked into the folder, its modules import
		say "no pip for $PYTHON: unpacking the wheels instead"
		for w in "${todo[@]}"; do
			"$PYTHON" -m zipfile -e "$w" "$SCRATCH" || die "could not unpack $w"
		done
	fi
fi
ln -sfn "$REPO/patches" "$SCRATCH/megatron_mllm_patches"
export PYTHONPATH="$REPO:$SCRATCH${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MEGATRON_MLLM_GPU_CHECK=1 GPU_CHECK_OUT="$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1
if [[ -z "${GPU_CHECK_ALL:-}" ]]; then
	export MEGATRON_MLLM_DESELECT_OVER_GPUS=1
fi

# 3. Everything imports (one line naming what does not), and CUDA is there (conftest's line).
"$PYTHON" -c "
import einops, mathgenerator, megatron.core, megatron.energon, yaml
import megatron_mllm_patches, megatron_mllm.runtime.modes.runs
print('imports: megatron-core', megatron.core.__version__, 'from', megatron.core.__path__[0])
" >>"$LOG" 2>&1 || die "imports failed: $(grep -E 'Error|error' "$LOG" | tail -1)"
"$PYTHON" tests/conftest.py 2>&1 | tee -a "$LOG"
((PIPESTATUS[0] == 0)) || exit 1

# 4. The tests marked gpu, under a time limit that leaves the run well inside 8 minutes.
say "pytest -m gpu (limit ${TIMEOUT_S} s)"
timeout -k 15 "$TIMEOUT_S" "$PYTHON" -m pytest -q -m gpu tests -rfEs -p no:cacheprovider \
	--durations=0 --junitxml="$OUT/junit.xml" -o junit_family=xunit2 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
cat "$OUT/pytest.log" >>"$LOG"
((rc == 124 || rc == 137)) && say "pytest ran past its ${TIMEOUT_S} s limit and was stopped"

# 5. A summary for the closing note: counts, each test's outcome and seconds.
"$PYTHON" - "$OUT" "$rc" "$(($(date +%s) - START))" <<'EOF' | tee -a "$LOG"
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, rc, seconds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tests, counts = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
if (out / "junit.xml").exists():
    for case in ET.parse(out / "junit.xml").iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = {"failure": "failed"}.get(tag, tag), node.get("message", "")
        counts[outcome] += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        tests.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0)),
                      "message": message.splitlines()[0] if message else ""})
deselected = [
    line for line in (out / "pytest.log").read_text().splitlines()
    if line.startswith("gpu-check: deselected")
] if (out / "pytest.log").exists() else []
summary = {"pytest_exit_code": rc, "seconds": seconds, **counts,
           "deselected_for_gpus": deselected[0] if deselected else "", "tests": tests}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"gpu_check: {counts['passed']} passed, {counts['failed']} failed, "
      f"{counts['error']} errors, {counts['skipped']} skipped in {seconds} s "
      f"(pytest exit {rc}); logs, junit.xml and summary.json in {out}")
EOF
exit "$rc"
