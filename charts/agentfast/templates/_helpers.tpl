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
{{- if .Values.postgresql.bundled -}}agentfast-postgres{{- else -}}{{ .Values.externalDatabase.existingSecret }}{{- end -}}
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
