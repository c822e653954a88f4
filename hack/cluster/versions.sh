# shellcheck shell=bash disable=SC2034
# Pinned versions of every upstream part of the local cluster tier. Sourced by hack/cluster/*.sh.
# Kubernetes 1.34 is the last minor whose kubelet starts on a cgroup v1 host without opting out of
# failCgroupV1 (1.35 refuses by default); CI machines here are cgroup v1.
K8S_VERSION="${K8S_VERSION:-v1.34.4}"
# Staging modules (k8s.io/api, k8s.io/apiserver, ...) are published as v0.MINOR.PATCH.
K8S_STAGING_VERSION="v0.${K8S_VERSION#v1.}"
# The etcd that k8s.io/kubernetes v1.34's go.mod pins for its client.
ETCD_VERSION="${ETCD_VERSION:-v3.6.4}"
HELM_VERSION="${HELM_VERSION:-v3.19.5}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.14.3}"
# crictl is a convenience for debugging and for the e2e suite's "container is gone" check.
CRICTL_VERSION="${CRICTL_VERSION:-v1.34.0}"
# Release tooling (hack/release.sh and its tests, tests/test_release.py): a real OCI registry on
# localhost for `helm push`/`helm pull` (the CNCF distribution registry), and krew, to install the
# kubectl plugin from its manifest the way users do.
REGISTRY_VERSION="${REGISTRY_VERSION:-v3.1.2}"
KREW_VERSION="${KREW_VERSION:-v0.4.3}"
