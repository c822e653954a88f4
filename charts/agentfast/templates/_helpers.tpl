{{- define "agentfast.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 40 | trimSuffix "-" }}{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "agentfast.labels" -}}
app.kubernetes.io/name: agentfast
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The one image of the operator, the runners and the bundled Postgres; its tag defaults to the
     chart's appVersion, so a released chart runs the image released with it. */}}
{{- define "agentfast.image" -}}
{{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end -}}

{{/* The Secret holding the DSN, read by the operator and by every runner pod (key: dsn). */}}
{{- define "agentfast.dsnSecret" -}}
{{- if .Values.postgresql.bundled -}}{{ .Values.postgresql.existingSecret | default "agentfast-postgres" }}{{- else -}}{{ .Values.externalDatabase.existingSecret }}{{- end -}}
{{- end -}}

{{- define "agentfast.dsnKey" -}}
{{- if .Values.postgresql.bundled -}}dsn{{- else -}}{{ .Values.externalDatabase.key }}{{- end -}}
{{- end -}}

{{- define "agentfast.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Where runner pods may connect (networkPolicy.enabled), as JSON for the operator's
     AGENTFAST_NETWORK_POLICY: egress rules for DNS, Postgres and the model endpoints. */}}
{{- define "agentfast.egressPolicy" -}}
{{- $np := .Values.networkPolicy -}}
{{- $pg := $np.postgresEgress -}}
{{- if not $pg -}}
{{- if .Values.postgresql.bundled -}}
{{- $peer := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (dict "app.kubernetes.io/instance" .Release.Name "app.kubernetes.io/component" "postgresql")) -}}
{{- $pg = list (dict "to" (list $peer) "ports" (list (dict "protocol" "TCP" "port" 5432))) -}}
{{- else -}}
{{- fail "networkPolicy.enabled with an external database needs networkPolicy.postgresEgress: egress rules that reach it (a NetworkPolicy names pods, namespaces and IP blocks, never a host)" -}}
{{- end -}}
{{- end -}}
{{- dict "dns" $np.dnsEgress "postgres" $pg "model" $np.modelEgress "mcp" ($np.mcpEgress | default list) | toJson -}}
{{- end -}}

{{/* The bundled server's generated credentials, as JSON {"password": superuser's, "dsn": role
     agentfast's}: generated at install (32 random letters and digits each) and read back from
     the Secret with lookup on upgrade, so they are stable. `helm template` has no lookup and
     generates new ones on every render: GitOps renders set postgresql.existingSecret instead.
     Computed once per render (kept in .Values) so the Secret and the operator's checksum agree. */}}
{{- define "agentfast.bundledCredentials" -}}
{{- if not (hasKey .Values "agentfastGeneratedCredentials") -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace "agentfast-postgres" -}}
{{- $password := randAlphaNum 32 -}}
{{- $appPassword := randAlphaNum 32 -}}
{{- if and $existing $existing.data -}}
{{- if hasKey $existing.data "password" -}}{{- $password = index $existing.data "password" | b64dec -}}{{- end -}}
{{- if hasKey $existing.data "dsn" -}}
{{- $old := index $existing.data "dsn" | b64dec -}}
{{- if hasPrefix "postgresql://agentfast:" $old -}}{{- $appPassword = $old | trimPrefix "postgresql://agentfast:" | splitList "@" | first -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- $dsn := printf "postgresql://agentfast:%s@%s-postgresql.%s.svc:5432/postgres?connect_timeout=5" $appPassword (include "agentfast.fullname" .) .Release.Namespace -}}
{{- $_ := set .Values "agentfastGeneratedCredentials" (dict "password" $password "dsn" $dsn) -}}
{{- end -}}
{{- index .Values "agentfastGeneratedCredentials" | toJson -}}
{{- end -}}

{{/*
The operator's rights in a namespace it serves (templates/rbac.yaml: in the ClusterRole when it
watches every namespace, else in a Role in each of operator.watchNamespaces). Each verb is one
a call makes; tests/test_chart.py lists the calls.
*/}}
{{- define "agentfast.operatorRules" -}}
# AgentRuns: kopf lists and watches them and patches its annotations and finalizer on them; the
# resync lists them, a runner pod's event reads its run by name (operator/main.py).
- apiGroups: [agentfast.dev]
  resources: [agentruns]
  verbs: [get, list, watch, patch]
- apiGroups: [agentfast.dev]
  resources: [agentruns/status]
  verbs: [patch]
# ModelConfigs: one read by name when a run is registered; never written. The Secrets they name
# are mounted by the runner pod, never read by the operator.
- apiGroups: [agentfast.dev]
  resources: [modelconfigs]
  verbs: [get]
# Runner pods: kopf watches them (label-selected), the reconcile lists a run's, creates one per
# attempt (operator/lifecycle.py) and deletes stopped ones.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# The runner credential: one Secret, agentfast-runner, per namespace that runs AgentRuns
# (operator/credentials.py, workload.RUNNER_SECRET). The operator reads, replaces and (when no
# run is left there) deletes that one only, and RBAC holds it to that name; it cannot limit
# create to a name. No other Secret (a ModelConfig's key, a team's tools') can be read.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: [""]
  resources: [secrets]
  resourceNames: [agentfast-runner]
  verbs: [get, update, delete]
{{- if .Values.networkPolicy.enabled }}
# networkPolicy.enabled: one egress NetworkPolicy per runner pod, owned by its AgentRun, read and
# deleted (with a uid precondition, only one the run owns) with an ended run's pods.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, delete]
{{- end }}
{{- if .Values.runner.serviceAccount.create }}
# runner.serviceAccount.create: the runner pods' ServiceAccount, with the chart's annotations
# (operator/identity.py), and that one only (workload.DEFAULT_RUNNER_SERVICE_ACCOUNT when no
# name is given). Nothing is bound to it; it never patches one it did not make.
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [create]
- apiGroups: [""]
  resources: [serviceaccounts]
  resourceNames: [{{ .Values.runner.serviceAccount.name | default "agentfast-runner" | quote }}]
  verbs: [get, patch]
{{- end }}
{{- end }}
