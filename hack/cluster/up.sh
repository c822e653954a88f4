#!/usr/bin/env bash
# Start a real single-node Kubernetes on this machine from the binaries of build.sh and the images
# of images.sh: etcd, kube-apiserver (TLS, RBAC+Node authorization, service-account signing),
# kube-controller-manager, kube-scheduler, containerd (CRI, CNI bridge, cgroupfs), kubelet,
# kube-proxy (iptables) and CoreDNS as a Deployment in kube-system. Every daemon runs in the
# background with its log and pid under $AGENTFAST_CACHE/cluster. Waits until the node is Ready,
# CoreDNS answers, and a pod reaches another pod by a Service name through cluster DNS, then prints
# the kubeconfig path. Idempotent: running daemons are left alone.
#
#   hack/cluster/up.sh            # needs build.sh and images.sh to have run
#   export KUBECONFIG=$(hack/cluster/up.sh)
# shellcheck source=hack/cluster/lib.sh
. "$(dirname "$0")/lib.sh"

[ "$(id -u)" = 0 ] || die "the kubelet and containerd need root"
for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
  [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b missing: run hack/cluster/build.sh first"
done
export PATH="$BIN_DIR:$PATH"
start=$SECONDS

PKI="$CLUSTER_DIR/pki"
ETC="$CLUSTER_DIR/etc"
HOST_IP="$(host_ip)"
mkdir -p "$PKI" "$ETC" "$LOG_DIR" "$PID_DIR"

# --- host settings the kubelet and kube-proxy rely on -----------------------------------------
# Forwarding, br_netfilter and FORWARD rules for the pod bridge (lib.sh; down.sh restores them).
ensure_host_network
# Mount propagation for volumes (the kubelet and containerd expect a shared root, as on systemd hosts).
mount --make-rshared / 2>/dev/null || log "warning: could not make / rshared"

# --- certificates ------------------------------------------------------------------------------
# gen_cert NAME SUBJECT [SANS]: a key and a certificate signed by the cluster CA, made once.
gen_cert() {
  local name="$1" subj="$2" sans="${3:-}"
  [ -s "$PKI/$name.crt" ] && return 0
  local ext="$PKI/$name.ext"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [ -n "$sans" ]; then
      echo "extendedKeyUsage=serverAuth,clientAuth"
      echo "subjectAltName=$sans"
    else
      echo "extendedKeyUsage=clientAuth"
    fi
  } >"$ext"
  openssl genrsa -out "$PKI/$name.key" 2048 2>/dev/null
  openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$ext"
}

make_pki() {
  if [ ! -s "$PKI/ca.crt" ]; then
    log "pki: new cluster CA in $PKI"
    openssl genrsa -out "$PKI/ca.key" 2048 2>/dev/null
    openssl req -x509 -new -key "$PKI/ca.key" -subj "/CN=agentfast-cluster-ca" -days 3650 -sha256 \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
      -out "$PKI/ca.crt" 2>/dev/null
  fi
  # The apiserver's serving certificate names every way it is reached, including the Service IP.
  # A changed host address means a new certificate.
  if [ -s "$PKI/apiserver.crt" ] && ! openssl x509 -in "$PKI/apiserver.crt" -noout -text | grep >/dev/null "IP Address:$HOST_IP"; then
    rm -f "$PKI/apiserver.crt" "$PKI/kubelet-serving.crt"
  fi
  gen_cert apiserver "/CN=kube-apiserver" \
    "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.$CLUSTER_DOMAIN,DNS:localhost,DNS:$NODE_NAME,IP:127.0.0.1,IP:$KUBERNETES_SVC_IP,IP:$HOST_IP"
  gen_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
  gen_cert admin "/O=system:masters/CN=kubernetes-admin"
  gen_cert controller-manager "/CN=system:kube-controller-manager"
  gen_cert scheduler "/CN=system:kube-scheduler"
  gen_cert kube-proxy "/CN=system:kube-proxy"
  gen_cert kubelet "/O=system:nodes/CN=system:node:$NODE_NAME"
  gen_cert kubelet-serving "/CN=$NODE_NAME" "DNS:$NODE_NAME,DNS:localhost,IP:127.0.0.1,IP:$HOST_IP"
  if [ ! -s "$PKI/sa.key" ]; then
    openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
    openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  fi
  chmod 600 "$PKI"/*.key
}

# write_kubeconfig FILE CERT_NAME SERVER
write_kubeconfig() {
  local file="$1" name="$2" server="$3"
  write_if_changed "$file" <<YAML
apiVersion: v1
kind: Config
clusters:
- name: agentfast
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <"$PKI/ca.crt")
users:
- name: $name
  user:
    client-certificate-data: $(base64 -w0 <"$PKI/$name.crt")
    client-key-data: $(base64 -w0 <"$PKI/$name.key")
contexts:
- name: agentfast
  context: {cluster: agentfast, user: $name}
current-context: agentfast
YAML
  chmod 600 "$file"
}

make_pki
SERVER="https://$HOST_IP:$APISERVER_PORT"
write_kubeconfig "$KUBECONFIG_ADMIN" admin "$SERVER"
for c in controller-manager scheduler kube-proxy kubelet; do
  write_kubeconfig "$ETC/$c.kubeconfig" "$c" "$SERVER"
done

# --- etcd ---------------------------------------------------------------------------------------
# Loopback only: the apiserver is its one client.
start_daemon etcd "$BIN_DIR/etcd" \
  --name=agentfast --data-dir="$CLUSTER_DIR/etcd" \
  --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
  --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
  --initial-cluster=agentfast=http://127.0.0.1:2380 \
  --listen-metrics-urls=http://127.0.0.1:2381 \
  --quota-backend-bytes=2147483648 --snapshot-count=10000 --log-level=warn
etcd_ready() { curl -fsS http://127.0.0.1:2381/health | grep >/dev/null '"health":"true"'; }
wait_for etcd 60 etcd_ready

# --- kube-apiserver -------------------------------------------------------------------------------
start_daemon kube-apiserver "$BIN_DIR/kube-apiserver" \
  --advertise-address="$HOST_IP" --bind-address=0.0.0.0 --secure-port="$APISERVER_PORT" \
  --etcd-servers=http://127.0.0.1:2379 \
  --service-cluster-ip-range="$SERVICE_CIDR" \
  --client-ca-file="$PKI/ca.crt" \
  --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
  --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
  --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
  --kubelet-certificate-authority="$PKI/ca.crt" \
  --kubelet-preferred-address-types=InternalIP,Hostname \
  --service-account-issuer="https://kubernetes.default.svc.$CLUSTER_DOMAIN" \
  --service-account-key-file="$PKI/sa.pub" \
  --service-account-signing-key-file="$PKI/sa.key" \
  --authorization-mode=Node,RBAC \
  --enable-admission-plugins=NodeRestriction \
  --allow-privileged=true \
  --profiling=false \
  --event-ttl=1h
apiserver_ready() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" get --raw /readyz; }
wait_for kube-apiserver 120 apiserver_ready

# --- controller-manager and scheduler ------------------------------------------------------------
start_daemon kube-controller-manager "$BIN_DIR/kube-controller-manager" \
  --kubeconfig="$ETC/controller-manager.kubeconfig" \
  --authentication-kubeconfig="$ETC/controller-manager.kubeconfig" \
  --authorization-kubeconfig="$ETC/controller-manager.kubeconfig" \
  --bind-address=127.0.0.1 --leader-elect=false \
  --client-ca-file="$PKI/ca.crt" --root-ca-file="$PKI/ca.crt" \
  --service-account-private-key-file="$PKI/sa.key" --use-service-account-credentials=true \
  --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
  --allocate-node-cidrs=true --cluster-cidr="${POD_CIDR%.*}.0/16" --node-cidr-mask-size=24 \
  --service-cluster-ip-range="$SERVICE_CIDR" \
  --controllers='*,bootstrapsigner,tokencleaner' --profiling=false
start_daemon kube-scheduler "$BIN_DIR/kube-scheduler" \
  --kubeconfig="$ETC/scheduler.kubeconfig" \
  --authentication-kubeconfig="$ETC/scheduler.kubeconfig" \
  --authorization-kubeconfig="$ETC/scheduler.kubeconfig" \
  --bind-address=127.0.0.1 --leader-elect=false --profiling=false

# --- containerd and the kubelet ------------------------------------------------------------------
ensure_containerd
for img in "$PAUSE_IMAGE" "docker.io/library/$PYTHON_BASE_IMAGE"; do
  if ! ctr -n k8s.io images ls -q | grep -x >/dev/null "$img"; then
    die "$img is not in containerd's k8s.io namespace: run hack/cluster/images.sh"
  fi
done
write_if_changed "$ETC/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: Webhook}
tlsCertFile: "$PKI/kubelet-serving.crt"
tlsPrivateKeyFile: "$PKI/kubelet-serving.key"
containerRuntimeEndpoint: "unix://$CONTAINERD_SOCK"
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
clusterDNS: ["$DNS_SVC_IP"]
clusterDomain: "$CLUSTER_DOMAIN"
resolvConf: /etc/resolv.conf
podCIDR: "$POD_CIDR"
maxPods: 60
serializeImagePulls: false
# Only our own images exist here; never garbage-collect them for disk use below 95%.
imageGCHighThresholdPercent: 95
imageGCLowThresholdPercent: 90
evictionHard: {"memory.available": "200Mi", "nodefs.available": "2%", "imagefs.available": "2%"}
rotateCertificates: false
serverTLSBootstrap: false
YAML
[ "$WRITE_CHANGED" = 0 ] || stop_daemon kubelet
start_daemon kubelet "$BIN_DIR/kubelet" \
  --config="$ETC/kubelet.yaml" --kubeconfig="$ETC/kubelet.kubeconfig" \
  --hostname-override="$NODE_NAME" --node-ip="$HOST_IP" \
  --root-dir=/var/lib/kubelet --v=1

# --- kube-proxy ----------------------------------------------------------------------------------
write_if_changed "$ETC/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$ETC/kube-proxy.kubeconfig"}
mode: iptables
clusterCIDR: "${POD_CIDR%.*}.0/16"
hostnameOverride: "$NODE_NAME"
bindAddress: 0.0.0.0
nodePortAddresses: ["primary"]
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# Leave the host's conntrack table size alone.
conntrack: {maxPerCore: 0}
YAML
[ "$WRITE_CHANGED" = 0 ] || stop_daemon kube-proxy
start_daemon kube-proxy "$BIN_DIR/kube-proxy" --config="$ETC/kube-proxy.yaml"

K="kubectl --kubeconfig $KUBECONFIG_ADMIN"
# The kubelet's own health first: after a restart the Node object still says Ready from before.
kubelet_healthy() { curl -fsS http://127.0.0.1:10248/healthz | grep -x >/dev/null ok; }
wait_for "kubelet healthz" 120 kubelet_healthy
node_ready() { $K get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -x >/dev/null True; }
wait_for "node $NODE_NAME Ready" 180 node_ready

# --- CoreDNS -------------------------------------------------------------------------------------
sed -e "s|@COREDNS_IMAGE@|$COREDNS_IMAGE|g" -e "s|@DNS_SVC_IP@|$DNS_SVC_IP|g" \
  -e "s|@CLUSTER_DOMAIN@|$CLUSTER_DOMAIN|g" "$HACK_CLUSTER_DIR/coredns.yaml" | $K apply -f - >/dev/null
coredns_available() { $K -n kube-system rollout status deploy/coredns --timeout=2s; }
wait_for "CoreDNS rollout" 180 coredns_available
# Ask the kube-dns Service (through kube-proxy's rules) for the API server's Service name.
dns_answers() {
  python3 - "$DNS_SVC_IP" "kubernetes.default.svc.$CLUSTER_DOMAIN" "$KUBERNETES_SVC_IP" <<'PY'
import socket, struct, sys
server, name, want = sys.argv[1:4]
q = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
s.sendto(q, (server, 53)); r = s.recv(512)
sys.exit(0 if socket.inet_aton(want) in r else 1)
PY
}
wait_for "CoreDNS answers kubernetes.default via $DNS_SVC_IP" 60 dns_answers

# --- the pod network, checked from inside the cluster ---------------------------------------------
# The host-side DNS query above passes even when the host's FORWARD chain drops traffic between
# pods. So a client pod resolves a Service name through cluster DNS (pod -> CoreDNS pod), then opens
# TCP connections to a server pod, straight to its IP (headless Service) and through its ClusterIP
# (kube-proxy's NAT). The cluster is ready only when all of it works.
NETCHECK_NS="agentfast-netcheck"
netcheck_manifest() {
  cat <<YAML
apiVersion: v1
kind: Namespace
metadata: {name: $NETCHECK_NS}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: $NETCHECK_NS, labels: {app: netcheck-server}}
spec:
  terminationGracePeriodSeconds: 0
  containers:
  - name: server
    image: $PYTHON_BASE_IMAGE
    imagePullPolicy: Never
    command: ["python3", "-m", "http.server", "8080"]
    readinessProbe: {tcpSocket: {port: 8080}, periodSeconds: 1}
---
apiVersion: v1
kind: Service
metadata: {name: server, namespace: $NETCHECK_NS}
spec: {selector: {app: netcheck-server}, ports: [{port: 80, targetPort: 8080}]}
---
apiVersion: v1
kind: Service
metadata: {name: server-direct, namespace: $NETCHECK_NS}
spec: {clusterIP: None, selector: {app: netcheck-server}, ports: [{port: 8080}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: $NETCHECK_NS}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 0
  containers:
  - name: client
    image: $PYTHON_BASE_IMAGE
    imagePullPolicy: Never
    command:
    - python3
    - -c
    - |
      import socket, time
      checks = [("server-direct.$NETCHECK_NS.svc.$CLUSTER_DOMAIN", 8080, "pod IP"),
                ("server.$NETCHECK_NS.svc.$CLUSTER_DOMAIN", 80, "ClusterIP")]
      deadline, last = time.monotonic() + 90, {}
      todo = list(checks)
      while todo and time.monotonic() < deadline:
          for name, port, how in list(todo):
              try:
                  ip = socket.gethostbyname(name)
              except OSError as e:
                  last[name] = f"DNS lookup of {name} through cluster DNS failed: {e}"; continue
              try:
                  socket.create_connection((ip, port), timeout=3).close()
              except OSError as e:
                  last[name] = f"TCP to {name} ({how} {ip}:{port}) failed: {e}"; continue
              print(f"ok: {name} -> {ip}:{port} ({how})", flush=True); todo.remove((name, port, how))
          time.sleep(1)
      for name, _, _ in todo:
          print("FAIL:", last.get(name), flush=True)
      raise SystemExit(1 if todo else 0)
YAML
}
netcheck_phase() { $K -n "$NETCHECK_NS" get pod client -o jsonpath='{.status.phase}' 2>/dev/null; }
netcheck_done() { case "$(netcheck_phase)" in Succeeded|Failed) return 0 ;; *) return 1 ;; esac; }
$K delete namespace "$NETCHECK_NS" --ignore-not-found --wait=true --timeout=120s >/dev/null
# (Pods are refused until the new namespace's default ServiceAccount exists: apply until accepted.)
netcheck_apply() { netcheck_manifest | $K apply -f -; }
wait_for "the network check's pods created" 60 netcheck_apply
netcheck_start=$SECONDS
until netcheck_done || (( SECONDS - netcheck_start >= 150 )); do sleep 1; done
if [ "$(netcheck_phase)" != Succeeded ]; then
  log "in-cluster network check failed (phase: $(netcheck_phase)):"
  $K -n "$NETCHECK_NS" logs client >&2 2>&1 || true
  $K -n "$NETCHECK_NS" get pods,endpoints -o wide >&2 || true
  log "host: net.ipv4.ip_forward=$(sysctl -n net.ipv4.ip_forward) bridge-nf-call-iptables=$(sysctl -n net.bridge.bridge-nf-call-iptables 2>/dev/null || echo n/a)"
  iptables -w -S FORWARD >&2 || true
  die "pods cannot reach each other: see the lines above (the client pod's own report first)"
fi
$K -n "$NETCHECK_NS" logs client 2>/dev/null | while read -r line; do log "netcheck: $line"; done
$K delete namespace "$NETCHECK_NS" --wait=false >/dev/null

log "cluster up in $((SECONDS - start))s; kubeconfig: $KUBECONFIG_ADMIN"
echo "$KUBECONFIG_ADMIN"
