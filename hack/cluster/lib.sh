# shellcheck shell=bash disable=SC2034
# Shared settings for hack/cluster/*.sh. Everything the cluster tier downloads, builds or runs lives
# under $AGENTFAST_CACHE (outside the repository), so re-runs are incremental and `git status` stays
# clean.
set -euo pipefail

HACK_CLUSTER_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$HACK_CLUSTER_DIR/../.." && pwd)"
# shellcheck source=hack/cluster/versions.sh
. "$HACK_CLUSTER_DIR/versions.sh"

# The cache directory (AGENTFAST_CACHE), the Python environment and the e2e steps: one definition for
# every hack/ script.
# shellcheck source=hack/lib.sh
. "$REPO_ROOT/hack/lib.sh"
CLUSTER_DIR="$AGENTFAST_CACHE/cluster"          # state of the running cluster (certs, logs, pids)
BIN_DIR="$AGENTFAST_CACHE/k8s-bin/$K8S_VERSION" # built binaries, one folder per pinned version
SRC_DIR="$AGENTFAST_CACHE/k8s-src"              # small wrapper Go modules
KUBECONFIG_ADMIN="$CLUSTER_DIR/kubeconfig"

# Go caches outside the repo, shared by every build here.
export GOMODCACHE="${GOMODCACHE_OVERRIDE:-$AGENTFAST_CACHE/go/mod}"
export GOCACHE="${GOCACHE_OVERRIDE:-$AGENTFAST_CACHE/go/build}"
export GOPATH="$AGENTFAST_CACHE/go/path"
export GOTOOLCHAIN=local
export CGO_ENABLED=0
# Parallel compile jobs; the cluster build runs at nice 19 so other work on the machine keeps the CPU.
BUILD_JOBS="${AGENTFAST_BUILD_JOBS:-2}"

# Names the cluster uses.
NODE_NAME="${AGENTFAST_NODE_NAME:-agentfast-node}"
SERVICE_CIDR="10.96.0.0/16"
KUBERNETES_SVC_IP="10.96.0.1"
DNS_SVC_IP="10.96.0.10"
POD_CIDR="10.244.0.0/24"
CLUSTER_DOMAIN="cluster.local"
APISERVER_PORT=6443

# Images the local tier makes or builds, and that the official path pulls.
PAUSE_IMAGE="registry.k8s.io/pause:3.10.1"
COREDNS_IMAGE="registry.k8s.io/coredns/coredns:${COREDNS_VERSION}"
PYTHON_BASE_IMAGE="python:3.11-slim-bookworm"
PROJECT_IMAGE="${AGENTFAST_PRODUCTION_IMAGE:-agentfast:dev}"
# The Dockerfile's testing target: the production image plus agentfast.testing (the scripted
# model, fault points, test tools). The e2e suite installs the chart with it.
TESTING_IMAGE="${AGENTFAST_TESTING_IMAGE:-agentfast-testing:dev}"
# A team's own tools in an image FROM the production one (hack/lib.sh, build_team_tools_image).
TEAM_IMAGE="${AGENTFAST_TEAM_IMAGE:-agentfast-team-tools:dev}"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# host_ip: the address of the interface that carries the default route, or the first global address.
host_ip() {
  local ip
  ip="$(ip -4 route get 1.1.1.1 2>/dev/null | awk '{for (i=1;i<NF;i++) if ($i=="src") print $(i+1)}' | head -n1)"
  if [ -z "$ip" ]; then
    ip="$(ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -n1)"
  fi
  [ -n "$ip" ] || die "no IPv4 address found on this machine"
  echo "$ip"
}

# write_if_changed FILE: stdin to FILE, leaving FILE untouched when the content is the same (some
# daemons, kube-proxy among them, exit when their config file is rewritten).
write_if_changed() {
  local f="$1" tmp
  tmp="$(mktemp "$f.XXXXXX")"
  cat >"$tmp"
  if cmp -s "$tmp" "$f" 2>/dev/null; then
    rm -f "$tmp"; WRITE_CHANGED=0
  else
    chmod 644 "$tmp"; mv "$tmp" "$f"; WRITE_CHANGED=1
  fi
}

# wait_for DESCRIPTION TIMEOUT_SECONDS COMMAND...: poll COMMAND once a second until it succeeds.
wait_for() {
  local what="$1" timeout="$2"; shift 2
  local start=$SECONDS
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS - start >= timeout )); then
      die "timed out after ${timeout}s waiting for: $what"
    fi
    sleep 1
  done
  log "ready: $what ($((SECONDS - start))s)"
}

# --- background daemons -------------------------------------------------------------------------
# Each daemon runs detached (setsid) with its log in $CLUSTER_DIR/logs/NAME.log and its pid in
# $CLUSTER_DIR/pids/NAME.pid; a daemon whose pid file names a live process of the same binary is left
# alone, so starting is idempotent.
LOG_DIR="$CLUSTER_DIR/logs"
PID_DIR="$CLUSTER_DIR/pids"

daemon_pid() { # NAME -> prints the pid if that daemon is alive
  local f="$PID_DIR/$1.pid" pid
  [ -f "$f" ] || return 1
  pid="$(cat "$f")"
  [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
  # The pid must still belong to a process started from the recorded binary (pids are reused).
  [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(cat "$PID_DIR/$1.exe" 2>/dev/null)" ] || return 1
  echo "$pid"
}

start_daemon() { # NAME BINARY ARGS...
  local name="$1"; shift
  mkdir -p "$LOG_DIR" "$PID_DIR"
  # A daemon started with other arguments (the scripts changed) is restarted.
  if daemon_pid "$name" >/dev/null && [ "$(cat "$PID_DIR/$name.args" 2>/dev/null)" != "$*" ]; then
    log "$name: arguments changed, restarting"
    stop_daemon "$name"
  fi
  if daemon_pid "$name" >/dev/null; then
    log "$name: already running (pid $(daemon_pid "$name"))"
    return 0
  fi
  local exe
  exe="$(readlink -f "$(command -v "$1")")"
  echo "$exe" >"$PID_DIR/$name.exe"
  echo "$*" >"$PID_DIR/$name.args"
  # shellcheck disable=SC2094
  { echo "=== $(date -u +%FT%TZ) starting: $*"; } >>"$LOG_DIR/$name.log"
  setsid nohup "$@" >>"$LOG_DIR/$name.log" 2>&1 </dev/null &
  echo $! >"$PID_DIR/$name.pid"
  log "$name: started (pid $!), log $LOG_DIR/$name.log"
}

stop_daemon() { # NAME [TIMEOUT]
  local name="$1" timeout="${2:-20}" pid
  if pid="$(daemon_pid "$name")"; then
    kill -TERM "$pid" 2>/dev/null || true
    local i=0
    while [ -d "/proc/$pid" ] && (( i < timeout * 10 )); do sleep 0.1; i=$((i + 1)); done
    if [ -d "/proc/$pid" ]; then
      log "$name: did not stop in ${timeout}s, sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    log "$name: stopped"
  fi
  rm -f "$PID_DIR/$name.pid" "$PID_DIR/$name.exe" "$PID_DIR/$name.args"
}

# --- host network settings -----------------------------------------------------------------------
# What a fresh host lacks for pod traffic, set before containerd, dockerd or the kubelet start, in any
# order and from any prior state:
#   br_netfilter + bridge-nf-call-iptables=1  so kube-proxy's Service NAT sees traffic between pods on cni0
#   net.ipv4.ip_forward=1                     pods reach each other, Services and the outside
#   FORWARD ACCEPT for cni0 in and out        a FORWARD policy of DROP (dockerd sets it when it turns
#                                             forwarding on itself; some hosts ship it) drops pod-to-pod
#                                             traffic once br_netfilter hands bridged frames to iptables
# Every change is recorded once in $HOST_STATE (the value before the first change), so down.sh
# puts back exactly what these scripts changed and nothing else.
HOST_STATE="$CLUSTER_DIR/host-state"
POD_BRIDGE="cni0"
FORWARD_RULES=("-i $POD_BRIDGE -j ACCEPT" "-o $POD_BRIDGE -j ACCEPT")
FORWARD_COMMENT="agentfast: pod network"

# record KEY VALUE: remember VALUE as KEY's original, unless an earlier run already did.
record_host_change() {
  mkdir -p "$(dirname "$HOST_STATE")"
  grep -q "^$1 " "$HOST_STATE" 2>/dev/null || echo "$1 $2" >>"$HOST_STATE"
}

set_sysctl() { # KEY VALUE
  local key="$1" want="$2" now
  now="$(sysctl -n "$key" 2>/dev/null)" || return 1
  [ "$now" = "$want" ] && return 0
  record_host_change "sysctl:$key" "$now"
  sysctl -qw "$key=$want"
}

ensure_host_network() {
  [ "$(id -u)" = 0 ] || die "the host network set-up needs root"
  if [ ! -e /proc/sys/net/bridge/bridge-nf-call-iptables ]; then
    if modprobe br_netfilter 2>/dev/null; then
      record_host_change "module:br_netfilter" "absent"
    else
      log "warning: br_netfilter is not loaded and modprobe failed: Service traffic between pods on one bridge may not be NATed"
    fi
  fi
  set_sysctl net.ipv4.ip_forward 1 || die "cannot read net.ipv4.ip_forward"
  set_sysctl net.bridge.bridge-nf-call-iptables 1 || true
  set_sysctl net.bridge.bridge-nf-call-ip6tables 1 || true
  command -v iptables >/dev/null || die "iptables is not installed: run hack/cluster/images.sh (apt-get install iptables)"
  local rule
  for rule in "${FORWARD_RULES[@]}"; do
    # shellcheck disable=SC2086
    if ! iptables -w -C FORWARD $rule -m comment --comment "$FORWARD_COMMENT" 2>/dev/null; then
      # shellcheck disable=SC2086
      iptables -w -I FORWARD 1 $rule -m comment --comment "$FORWARD_COMMENT"
      record_host_change "iptables:$rule" "inserted"
    fi
  done
}

# restore_host_network: undo what ensure_host_network recorded (down.sh).
restore_host_network() {
  [ -f "$HOST_STATE" ] || return 0
  local key value rule
  while read -r key value; do
    case "$key" in
      sysctl:*) sysctl -qw "${key#sysctl:}=$value" 2>/dev/null || true; log "host: ${key#sysctl:} back to $value" ;;
    esac
  done <"$HOST_STATE"
  for rule in "${FORWARD_RULES[@]}"; do
    # shellcheck disable=SC2086
    while iptables -w -C FORWARD $rule -m comment --comment "$FORWARD_COMMENT" 2>/dev/null; do
      # shellcheck disable=SC2086
      iptables -w -D FORWARD $rule -m comment --comment "$FORWARD_COMMENT"
    done
  done
  log "host: FORWARD rules for $POD_BRIDGE removed"
  if grep -q '^module:br_netfilter ' "$HOST_STATE"; then
    modprobe -r br_netfilter 2>/dev/null || true
  fi
  rm -f "$HOST_STATE"
}

# --- containerd and docker ----------------------------------------------------------------------
# One containerd serves both the kubelet (CRI, namespace k8s.io) and dockerd (namespace moby), at the
# standard socket, with our own config file. cgroupfs driver: the host has no systemd, and is cgroup v1.
CONTAINERD_SOCK="/run/containerd/containerd.sock"
CNI_CONF_DIR="$CLUSTER_DIR/cni/net.d"
CNI_BIN_DIR="/usr/lib/cni"

# true when this process may not lower its oom_score_adj (no CAP_SYS_RESOURCE), e.g. in some VMs.
restrict_oom() {
  local capeff
  capeff="$(awk '/^CapEff:/ {print $2}' /proc/self/status)"
  if (( (16#$capeff >> 24) & 1 )); then echo false; else echo true; fi
}

write_containerd_config() {
  mkdir -p "$CLUSTER_DIR/etc" "$CNI_CONF_DIR"
  write_if_changed "$CLUSTER_DIR/etc/containerd.toml" <<TOML
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "$CONTAINERD_SOCK"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  enable_unprivileged_ports = true
  enable_unprivileged_icmp = true
  # Clamp the OOM score adjustments asked for (-998 for sandboxes, -997 for Guaranteed pods) to
  # containerd's own: raising is always allowed, lowering needs CAP_SYS_RESOURCE, which this
  # machine's root does not have (runc fails with "can't get final child's PID from pipe").
  restrict_oom_score_adj = $(restrict_oom)
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN_DIR"
    conf_dir = "$CNI_CONF_DIR"
TOML
  CONTAINERD_CONFIG_CHANGED="$WRITE_CHANGED"
  # The pod network: one Linux bridge, host-local IPAM on the node's pod CIDR, masquerade for traffic
  # leaving it, hairpin so a pod reaches itself through a Service.
  write_if_changed "$CNI_CONF_DIR/10-agentfast.conflist" <<JSON
{
  "cniVersion": "1.0.0",
  "name": "agentfast",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "mtu": $(cat /sys/class/net/"$(ip -4 route show default | awk '{print $5; exit}')"/mtu 2>/dev/null || echo 1500),
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
JSON
}

# (ctr waits 10s for a socket that is not there: look for the socket first.)
containerd_ready() { [ -S "$CONTAINERD_SOCK" ] && timeout 5 ctr --address "$CONTAINERD_SOCK" version >/dev/null 2>&1; }

ensure_containerd() {
  command -v containerd >/dev/null || die "containerd is not installed: run hack/cluster/images.sh (apt-get install containerd)"
  ensure_host_network
  write_containerd_config
  if [ "$CONTAINERD_CONFIG_CHANGED" = 1 ] && daemon_pid containerd >/dev/null; then
    log "containerd: config changed, restarting (running containers keep running)"
    stop_daemon containerd
  fi
  if containerd_ready && ! daemon_pid containerd >/dev/null; then
    log "containerd: a containerd not started by these scripts already serves $CONTAINERD_SOCK; using it"
    return 0
  fi
  start_daemon containerd containerd --config "$CLUSTER_DIR/etc/containerd.toml"
  wait_for "containerd" 60 containerd_ready
}

docker_ready() { docker version >/dev/null 2>&1; }

ensure_dockerd() {
  if docker_ready; then return 0; fi
  command -v dockerd >/dev/null || die "dockerd is not installed: run hack/cluster/images.sh (apt-get install docker.io)"
  ensure_containerd
  local mtu
  mtu="$(cat /sys/class/net/"$(ip -4 route show default | awk '{print $5; exit}')"/mtu 2>/dev/null || echo 1500)"
  # Image builds here run with --network none: dockerd has no reason to touch the host's firewall
  # (left to itself it sets the FORWARD policy to DROP, which drops pod traffic).
  start_daemon dockerd dockerd --containerd="$CONTAINERD_SOCK" --mtu="$mtu" --exec-opt native.cgroupdriver=cgroupfs \
    --iptables=false
  wait_for "dockerd" 60 docker_ready
}
