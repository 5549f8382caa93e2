#!/usr/bin/env bash
# Run the e2e suite on a local kind cluster: create it if needed, build and load the images, run pytest.
#   e2e/run-kind.sh            # KIND_CLUSTER=specfleet-e2e, keeps the cluster afterwards
# Needs docker, kind, kubectl and helm on PATH. Without them it says which is missing and exits 0
# (nothing to test against), so CI can call it unconditionally.
set -euo pipefail
cd "$(dirname "$0")/.."
cluster="${KIND_CLUSTER:-specfleet-e2e}"
for tool in docker kind kubectl helm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "e2e skipped: '$tool' is not on PATH (needs docker, kind, kubectl, helm); see docs/operator.md"
    exit 0
  fi
done
if ! kind get clusters 2>/dev/null | grep -qx "$cluster"; then
  kind create cluster --name "$cluster" --wait 120s
fi
kubectl config use-context "kind-$cluster" >/dev/null
export SPECFLEET_OPERATOR_IMAGE="${SPECFLEET_OPERATOR_IMAGE:-specfleet/operator:e2e}"
export SPECFLEET_ENGINE_CPU_IMAGE="${SPECFLEET_ENGINE_CPU_IMAGE:-specfleet/engine:e2e}"
DOCKER_BUILDKIT=1 docker build -f operator/Dockerfile -t "$SPECFLEET_OPERATOR_IMAGE" .
DOCKER_BUILDKIT=1 docker build -f engine/Dockerfile -t "$SPECFLEET_ENGINE_CPU_IMAGE" .
kind load docker-image --name "$cluster" "$SPECFLEET_OPERATOR_IMAGE" "$SPECFLEET_ENGINE_CPU_IMAGE"
# -P: the repository root off sys.path, where ./kernels would shadow the kernels package transformers imports
exec "${PYTHON:-.venv/bin/python}" -P -m pytest e2e -v -p no:cacheprovider "$@"
