"""The cluster tier: e2e tests against the cluster of KUBECONFIG (see docs/testing.md)."""
