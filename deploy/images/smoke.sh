#!/usr/bin/env bash
# Run the worker image against the embedded dev stack (`sluice dev up`) and wait for /readyz 200.
#   deploy/images/smoke.sh [IMAGE] [MODEL_DIR]
# Uses buildah (chroot isolation, host network), as on a build machine without a container daemon.
set -euo pipefail
image=${1:-localhost/sluice:cpu}
model=${2:-$PWD/.sluice/models/smollm2-135m-instruct}
port=${SLUICE_SMOKE_PORT:-19464}
B="buildah ${BUILDAH_OPTS:---storage-driver vfs}"
ctr=$($B from "$image")
trap '$B rm "$ctr" >/dev/null 2>&1 || true; pkill -f "SLUICE_SMOKE_MARK" 2>/dev/null || true' EXIT
$B run --isolation chroot "$ctr" -- sluice topics apply  # a worker does not create its topics
$B run --isolation chroot -v "$model:/models/model:ro" \
  --env SLUICE_MODEL=/models/model --env SLUICE_METRICS_PORT="$port" --env SLUICE_KAFKA_IDEMPOTENCE=false \
  --env SLUICE_GROUP_ID=image-smoke --env SLUICE_SMOKE_MARK=1 "$ctr" -- sluice worker > /tmp/sluice-image-smoke.log 2>&1 &
run=$!
for _ in $(seq 600); do
  if curl -fsS "http://127.0.0.1:$port/readyz" 2>/dev/null; then
    echo; curl -fsS "http://127.0.0.1:$port/metrics" | grep -c '^vllm:' | sed 's/^/vllm metric samples: /'
    kill -TERM $run 2>/dev/null; wait $run || true
    echo "image ready: $image"; exit 0
  fi
  kill -0 $run 2>/dev/null || { tail -20 /tmp/sluice-image-smoke.log; echo "the worker in $image exited" >&2; exit 1; }
  sleep 1
done
echo "the worker in $image never became ready" >&2; exit 1
