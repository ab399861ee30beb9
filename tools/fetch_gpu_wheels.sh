#!/usr/bin/env bash
# Run HERE (a machine that reaches the package index), before tools/gpu_check.sh goes to the GPU
# machine, which reaches no network: downloads Python 3.12 x86-64 wheels of megatron-core and of
# what our code and its imports need that the GPU machine lacks, into .gpu_wheels/ (ignored by
# git; it travels with the working tree). No torch: the GPU machine has its own CUDA build, and
# numpy, transformers, tokenizers, pillow, scikit-learn, pytest, hypothesis, matplotlib and
# tensorboard (with their dependencies: scipy, sympy, tqdm, regex, packaging, python-dateutil,
# six, typing-extensions, ...).
#
#   bash tools/fetch_gpu_wheels.sh [DEST]      # DEST defaults to .gpu_wheels
#
# GPU_PYTHON_VERSION (default 3.12) picks another Python's wheels, e.g. to rehearse here.
#
# Versions are the ones .venv runs the tests with. Left out on purpose: s3fs and its aiohttp
# stack (energon's S3 access; nothing here reads from S3).
set -euo pipefail

cd "$(dirname "$0")/.."
DEST="${1:-.gpu_wheels}"
PIP=(python3 -m pip)
if [[ -x .venv/bin/python ]]; then
	PIP=(.venv/bin/python -m pip)
fi

WHEELS=(
	# megatron-core and what it imports beyond torch, numpy and packaging
	megatron-core==0.16.1
	einops==0.8.2     # HyperCommGrid
	psutil==7.2.2     # dist_checkpointing
	# our own imports
	PyYAML==6.0.4     # schedule specs
	mathgenerator==1.5.0
	# megatron-energon (image-caption shards) and what `import megatron.energon` pulls in
	megatron-energon==7.4.1
	braceexpand==0.1.7
	click==8.5.1
	filetype==1.2.0
	mfusepy==3.1.1
	webdataset==1.0.2
	rapidyaml==0.15.2
	deprecation==2.1.0
	multi-storage-client==1.3.1
	attrs==26.1.0
	bracex==3.2.3
	wcmatch==10.2.1
	jmespath==1.1.0
	jsonschema==4.26.0
	jsonschema-specifications==2025.9.1
	referencing==0.37.0
	rpds-py==2026.9.1
	lark==1.3.1
	opentelemetry-api==1.45.2
	prettytable==3.18.0
	wcwidth==0.9.4
	pyroute2==0.9.7
	tzdata==2025.3
	xattr==1.3.0
	cffi==2.1.1
	pycparser==3.12
)

mkdir -p "$DEST"
"${PIP[@]}" download --quiet --no-deps --only-binary=:all: \
	--python-version "${GPU_PYTHON_VERSION:-3.12}" --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	-d "$DEST" "${WHEELS[@]}" 2> >(grep -v "is neither a file nor a directory" >&2)
count=$(find "$DEST" -maxdepth 1 -name '*.whl' | wc -l)
size=$(du -sh "$DEST" | cut -f1)
echo "fetch_gpu_wheels: ${count} wheels (${size}) in ${DEST}; next: run tools/gpu_check.sh on the GPU machine"
