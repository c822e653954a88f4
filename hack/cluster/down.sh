#!/usr/bin/env bash
# Stop the local cluster started by up.sh: the kubelet and kube-proxy first, then every pod's
# containers and sandbox (through the CRI, so the shims and the processes in them end), the control
# plane, and the containerd/dockerd these scripts started. Unmounts what the pods left mounted and
# removes the pod network's leftovers, and puts back the host settings (sysctls, FORWARD rules)
# that up.sh and images.sh changed. Keeps etcd's data, the certificates and the images, so the
# next up.sh is quick and the kubeconfig stays valid; `down.sh --purge` removes the cluster's state
# too (not the built binaries or images). Idempotent: safe to run when nothing is up.
# shellcheck source=hack/cluster/lib.sh
. "$(dirname "$0")/lib.sh"

purge=0
for a in "$@"; do
  case "$a" in
    --purge) purge=1 ;;
    *) die "usage: down.sh [--purge]" ;;
  esac
done
[ "$(id -u)" = 0 ] || die "needs root"
export PATH="$BIN_DIR:$PATH"

stop_daemon kubelet
stop_daemon kube-proxy

# Every pod sandbox and container in the kubelet's namespace, stopped and removed through the CRI.
if containerd_ready && [ -x "$BIN_DIR/crictl" ]; then
  crictl() { "$BIN_DIR/crictl" --runtime-endpoint "unix://$CONTAINERD_SOCK" --timeout 30s "$@"; }
  pods="$(crictl pods -q 2>/dev/null || true)"
  if [ -n "$pods" ]; then
    log "removing $(echo "$pods" | wc -l) pod sandbox(es) and their containers"
    # shellcheck disable=SC2086
    crictl stopp $pods >/dev/null 2>&1 || true
    # shellcheck disable=SC2086
    crictl rmp -f $pods >/dev/null 2>&1 || true
  fi
fi

stop_daemon kube-scheduler
stop_daemon kube-controller-manager
stop_daemon kube-apiserver
stop_daemon etcd

# dockerd and containerd only if these scripts started them.
stop_daemon dockerd
stop_daemon containerd

# What pods left behind: volume mounts (service-account tokens are tmpfs), sandbox shm, netns.
umount_under() {
  local dir="$1" m
  [ -d "$dir" ] || return 0
  # Deepest first.
  awk -v d="$dir" '$2 ~ "^"d {print $2}' /proc/self/mounts | sort -r | while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
}
umount_under /var/lib/kubelet/pods
if ! containerd_ready; then
  umount_under /run/containerd/io.containerd.grpc.v1.cri
  umount_under /run/containerd/io.containerd.runtime.v2.task
  for ns in /run/netns/cni-*; do
    [ -e "$ns" ] || continue
    umount "$ns" 2>/dev/null || true
    rm -f "$ns"
  done
fi
ip link del cni0 2>/dev/null || true
# The sysctls and FORWARD rules up.sh / images.sh changed, back as they were.
restore_host_network
# kube-proxy's rules.
if [ -x "$BIN_DIR/kube-proxy" ]; then
  "$BIN_DIR/kube-proxy" --cleanup >/dev/null 2>&1 || true
fi

if [ "$purge" = 1 ]; then
  log "purging cluster state: $CLUSTER_DIR, /var/lib/kubelet, CNI leases"
  umount_under /var/lib/kubelet
  rm -rf "$CLUSTER_DIR" /var/lib/kubelet /var/lib/cni/networks/agentfast
fi
log "cluster down"
