# shellcheck shell=bash disable=SC2034
# Steps shared by the two ways of running the e2e suite, so both run the same thing:
#   hack/cluster/e2e.sh  a single-node cluster built from upstream on this machine (no registry)
#   hack/kind-e2e.sh     kind, for machines with registry access (and .github/workflows/e2e-kind.yml)

E2E_RELEASE="${AGENTFAST_RELEASE:-agentfast}"
E2E_NAMESPACE="${AGENTFAST_NAMESPACE:-agentfast-system}"

# e2e_image_parts IMAGE -> "REPOSITORY TAG"
e2e_image_parts() {
  local image="$1"
  echo "${image%:*} ${image##*:}"
}

# e2e_helm_install REPO_ROOT IMAGE: install the project's chart with the image already on the node.
# The chart is optional while it does not exist yet; the smoke tests do not need it. An ended run's
# runner pods live 30 s (E2E_POD_TTL_SECONDS), not the chart's hour, so that
# tests/e2e/test_runner_pod_ttl.py sees them go; long enough for the tests that look at a pod just
# after its run ended.
e2e_helm_install() {
  local root="$1" image="$2" helm="${HELM:-helm}" repo tag
  read -r repo tag <<<"$(e2e_image_parts "$image")"
  if [ ! -f "$root/charts/agentfast/Chart.yaml" ]; then
    echo "e2e: charts/agentfast/Chart.yaml not present; skipping helm install" >&2
    return 0
  fi
  # Helm installs a chart's crds/ once and never upgrades them (helm.sh/docs/chart_best_practices/custom_resource_definitions):
  # apply them first, so a cluster kept from an earlier run gets this checkout's schema and CEL rules.
  "${KUBECTL:-kubectl}" apply --server-side --force-conflicts -f "$root/charts/agentfast/crds/"
  "${KUBECTL:-kubectl}" wait --for condition=established --timeout=60s -f "$root/charts/agentfast/crds/"
  "$helm" upgrade --install "$E2E_RELEASE" "$root/charts/agentfast" \
    --namespace "$E2E_NAMESPACE" --create-namespace \
    --set image.repository="$repo" --set image.tag="$tag" --set image.pullPolicy=IfNotPresent \
    --set runner.podTTLSecondsAfterFinished="${E2E_POD_TTL_SECONDS:-30}" \
    --wait --timeout 5m
  # An operator of the previous release keeps acting until its pod is gone (it holds the leader
  # Lease until then), and the runner pods it makes name the previous image, which images.sh has
  # replaced on the node: start the tests only once no operator pod of an older template is left.
  "${KUBECTL:-kubectl}" -n "$E2E_NAMESPACE" rollout status deploy/"$E2E_RELEASE"-operator --timeout=5m
  local hash
  hash="$("${KUBECTL:-kubectl}" -n "$E2E_NAMESPACE" get rs -l app.kubernetes.io/component=operator \
    -o jsonpath='{range .items[?(@.status.replicas>0)]}{.metadata.labels.pod-template-hash}{"\n"}{end}' | tail -1)"
  "${KUBECTL:-kubectl}" -n "$E2E_NAMESPACE" wait --for=delete pod \
    -l "app.kubernetes.io/component=operator,pod-template-hash!=$hash" --timeout=5m 2>/dev/null || true
}

# e2e_pytest REPO_ROOT [PYTEST ARGS...]: the e2e suite against $KUBECONFIG.
e2e_pytest() {
  local root="$1"; shift
  [ -n "${KUBECONFIG:-}" ] || { echo "e2e: KUBECONFIG is not set" >&2; return 1; }
  (cd "$root" && "${PYTHON:-python3}" -m pytest -m e2e tests/e2e "$@")
}
