{{/* Names: <release>-vllm-sessionkv unless the release name already holds the chart's. */}}
{{- define "skv.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "skv.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: include "skv.selector" (list . "prefill") */}}
{{- define "skv.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "skv.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{- define "skv.proxyImage" -}}
{{ printf "%s:%s" .Values.proxy.image.repository .Values.proxy.image.tag | quote }}
{{- end -}}

{{/* The stable DNS name of engine pod i of a pool: include "skv.engineHost" (list . "decode" 0) */}}
{{- define "skv.engineHost" -}}
{{- $root := index . 0 -}}
{{- $pool := printf "%s-%s" (include "skv.fullname" $root) (index . 1) -}}
{{- printf "%s-%d.%s.%s.svc.%s" $pool (index . 2) $pool $root.Release.Namespace $root.Values.clusterDomain -}}
{{- end -}}

{{/* Whether a Redis URL is configured (external, secret or bundled). */}}
{{- define "skv.redisEnabled" -}}
{{- if or .Values.redis.url .Values.redis.existingSecret.name .Values.redis.bundled.enabled -}}true{{- end -}}
{{- end -}}

{{/* The SESSIONKV_REDIS_URL variable for a container env list. */}}
{{- define "skv.redisEnv" -}}
- name: SESSIONKV_REDIS_URL
{{- if .Values.redis.existingSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret.name }}
      key: {{ .Values.redis.existingSecret.key }}
{{- else if .Values.redis.url }}
  value: {{ .Values.redis.url | quote }}
{{- else }}
  value: {{ printf "redis://%s-redis:%d/0" (include "skv.fullname" .) (int .Values.redis.bundled.port) | quote }}
{{- end }}
{{- end -}}

{{- define "skv.metricsAnnotations" -}}
{{- $root := index . 0 -}}
{{- if $root.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}
