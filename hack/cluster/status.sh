#!/usr/bin/env bash
# What the local cluster runs and the memory it uses: each daemon's pid and RSS, the containerd
# shims, the pods' own processes not counted. `status.sh` exits non-zero when a daemon is down.
# shellcheck source=hack/cluster/lib.sh
. "$(dirname "$0")/lib.sh"

total=0 down=0
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status" 2>/dev/null || echo 0; }
printf '%-24s %8s %9s\n' daemon pid rss_MiB
for n in etcd kube-apiserver kube-controller-manager kube-scheduler containerd kubelet kube-proxy dockerd; do
  if pid="$(daemon_pid "$n")"; then
    r="$(rss_kib "$pid")"; total=$((total + r))
    printf '%-24s %8s %9d\n' "$n" "$pid" $((r / 1024))
  else
    printf '%-24s %8s %9s\n' "$n" "-" "-"
    [ "$n" = dockerd ] || down=1
  fi
done
shims=0 n_shims=0
for pid in $(pgrep -f '^/usr/bin/containerd-shim-runc-v2 ' || true); do
  shims=$((shims + $(rss_kib "$pid"))); n_shims=$((n_shims + 1))
done
total=$((total + shims))
printf '%-24s %8s %9d\n' "containerd shims" "x$n_shims" $((shims / 1024))
printf '%-24s %8s %9d\n' "total" "" $((total / 1024))
if [ -f "$KUBECONFIG_ADMIN" ] && [ -x "$BIN_DIR/kubectl" ]; then
  "$BIN_DIR/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" get nodes -o wide 2>/dev/null || true
fi
exit "$down"
