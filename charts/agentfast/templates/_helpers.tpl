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

{{- define "agentfast.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
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
{{- dict "dns" $np.dnsEgress "postgres" $pg "model" $np.modelEgress | toJson -}}
{{- end -}}
