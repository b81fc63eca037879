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

{{/* Whether the bundled Redis runs: enabled, and no external URL or Secret given. */}}
{{- define "skv.bundledRedis" -}}
{{- if and .Values.redis.bundled.enabled (not .Values.redis.url) (not .Values.redis.existingSecret.name) -}}true{{- end -}}
{{- end -}}

{{/* A LabelSelector for this release's pods of some components: include "skv.podsOf" (list . "proxy" "prefill") */}}
{{- define "skv.podsOf" -}}
{{- $root := first . -}}
matchLabels:
  app.kubernetes.io/name: {{ $root.Chart.Name }}
  app.kubernetes.io/instance: {{ $root.Release.Name }}
matchExpressions:
  - {key: app.kubernetes.io/component, operator: In, values: [{{ rest . | join ", " }}]}
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

{{/* Fails the render on a half-set Secret reference: include "skv.checkSecretRef" (list "auth.apiKeySecret" .Values.auth.apiKeySecret) */}}
{{- define "skv.checkSecretRef" -}}
{{- $path := index . 0 -}}
{{- $ref := index . 1 -}}
{{- if and $ref.name (not $ref.key) -}}
{{- fail (printf "%s.name is %q but %s.key is empty: name the key in that Secret that holds the value" $path $ref.name $path) -}}
{{- else if and $ref.key (not $ref.name) -}}
{{- fail (printf "%s.key is %q but %s.name is empty: name the Secret (or clear both to turn it off)" $path $ref.key $path) -}}
{{- end -}}
{{- end -}}

{{/* Validates every auth value and proxy.tls once, before anything renders. */}}
{{- define "skv.checkSecrets" -}}
{{- range $value := list "apiKeySecret" "engineApiKeySecret" "sidePortSecret" -}}
{{- include "skv.checkSecretRef" (list (printf "auth.%s" $value) (index $.Values.auth $value)) -}}
{{- end -}}
{{- with .Values.proxy.tls -}}
{{- if and .secretName (not (and .certKey .keyKey)) -}}
{{- fail (printf "proxy.tls.secretName is %q but proxy.tls.certKey or proxy.tls.keyKey is empty: name the keys holding the certificate and its private key" .secretName) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* An env entry from a Secret: include "skv.secretEnv" (list "NAME" .Values.auth.apiKeySecret) */}}
{{- define "skv.secretEnv" -}}
{{- $ref := index . 1 -}}
- name: {{ index . 0 }}
  valueFrom:
    secretKeyRef:
      name: {{ $ref.name | quote }}
      key: {{ $ref.key | quote }}
{{- end -}}

{{/* The UCX_TCP_PORT_RANGE as a NetworkPolicy port ("5700-5799": port and endPort). */}}
{{- define "skv.ucxPorts" -}}
{{- $range := toString .Values.engine.ucx.tcpPortRange -}}
{{- if not (regexMatch "^[0-9]+(-[0-9]+)?$" $range) -}}
{{- fail (printf "engine.ucx.tcpPortRange must be PORT or FIRST-LAST (e.g. 5700-5799), got %q" $range) -}}
{{- end -}}
{{- $bounds := splitList "-" $range -}}
- protocol: TCP
  port: {{ first $bounds | int }}
{{- if gt (len $bounds) 1 }}
  endPort: {{ last $bounds | int }}
{{- end }}
{{- end -}}
