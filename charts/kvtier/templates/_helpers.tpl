{{/* Object names: "<release>-kvtier", or the release name when it already says kvtier. */}}
{{- define "kvtier.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvtier.operatorName" -}}
{{- printf "%s-operator" (include "kvtier.fullname" .) -}}
{{- end -}}

{{- define "kvtier.webhookSecretName" -}}
{{- default (printf "%s-webhook-tls" (include "kvtier.fullname" .)) .Values.webhook.tls.secretName -}}
{{- end -}}

{{- define "kvtier.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtier.operatorName" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvtier.labels" -}}
{{ include "kvtier.selectorLabels" . }}
app.kubernetes.io/part-of: kvtier
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvtier.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "kvtier.sidecarImage" -}}
{{- if .Values.sidecar.image.digest -}}
{{- printf "%s@%s" .Values.sidecar.image.repository .Values.sidecar.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.sidecar.image.repository (default .Chart.AppVersion .Values.sidecar.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The host of webhook.url ("" when unset), without port or brackets. */}}
{{- define "kvtier.webhookUrlHost" -}}
{{- if .Values.webhook.url -}}
{{- $host := (urlParse .Values.webhook.url).host -}}
{{- if hasPrefix "[" $host -}}
{{- regexReplaceAll "^\\[(.*)\\](:[0-9]+)?$" $host "${1}" -}}
{{- else -}}
{{- regexReplaceAll ":[0-9]+$" $host "" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The names the webhook's serving certificate must cover, as "dns:<name>" / "ip:<addr>". */}}
{{- define "kvtier.webhookSans" -}}
{{- $svc := include "kvtier.operatorName" . -}}
{{- $ns := .Release.Namespace -}}
{{- $sans := list (printf "dns:%s" $svc) (printf "dns:%s.%s" $svc $ns) (printf "dns:%s.%s.svc" $svc $ns) (printf "dns:%s.%s.svc.cluster.local" $svc $ns) -}}
{{- $host := include "kvtier.webhookUrlHost" . -}}
{{- if $host -}}
{{- if regexMatch "^[0-9.]+$|:" $host -}}
{{- $sans = append $sans (printf "ip:%s" $host) -}}
{{- else -}}
{{- $sans = append $sans (printf "dns:%s" $host) -}}
{{- end -}}
{{- end -}}
{{- join "," $sans -}}
{{- end -}}

{{/*
The webhook's TLS material as a dict {crt, key, ca} (base64 PEM; crt/key empty when the
user supplies the Secret). A generated pair is read back from the existing Secret on
upgrade (`lookup`) and kept while it still covers the same names, so an upgrade never
changes the caBundle under running pods. `helm template` has no cluster: it generates.
*/}}
{{- define "kvtier.webhookTLS" -}}
{{- if .Values.webhook.tls.secretName -}}
{{- dict "crt" "" "key" "" "ca" .Values.webhook.tls.caBundle | toJson -}}
{{- else -}}
{{- $sans := include "kvtier.webhookSans" . -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "kvtier.webhookSecretName" .) -}}
{{- $keep := and $existing (eq (index ($existing.metadata.annotations | default dict) "kvtier.io/sans" | default "") $sans) (index ($existing.data | default dict) "ca.crt") -}}
{{- if $keep -}}
{{- dict "crt" (index $existing.data "tls.crt") "key" (index $existing.data "tls.key") "ca" (index $existing.data "ca.crt") | toJson -}}
{{- else -}}
{{- $ips := list -}}
{{- $dns := list -}}
{{- range splitList "," $sans -}}
{{- if hasPrefix "ip:" . -}}{{- $ips = append $ips (trimPrefix "ip:" .) -}}{{- else -}}{{- $dns = append $dns (trimPrefix "dns:" .) -}}{{- end -}}
{{- end -}}
{{- $ca := genCA (printf "%s-webhook-ca" (include "kvtier.fullname" .)) (int .Values.webhook.tls.validityDays) -}}
{{- $cert := genSignedCert (first $dns) $ips $dns (int .Values.webhook.tls.validityDays) $ca -}}
{{- dict "crt" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc) "ca" ($ca.Cert | b64enc) | toJson -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The operator's control CA Secret (and its public ConfigMap twin). */}}
{{- define "kvtier.controlCaName" -}}
{{- .Values.controlTls.caSecretName | default (printf "%s-control-ca" (include "kvtier.fullname" .)) -}}
{{- end -}}

{{/* The kvtier EPP's image. */}}
{{- define "kvtier.eppImage" -}}
{{- $img := .Values.endpointPicker.image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* An EPP pool's selector labels; the argument is (dict "root" $ "pool" $pool). */}}
{{- define "kvtier.eppSelectorLabels" -}}
app.kubernetes.io/name: kvtier-epp
app.kubernetes.io/instance: {{ .root.Release.Name }}
kvtier.io/inference-pool: {{ .pool.name }}
{{- end -}}

{{- define "kvtier.eppLabels" -}}
{{ include "kvtier.eppSelectorLabels" . }}
app.kubernetes.io/component: endpoint-picker
app.kubernetes.io/part-of: kvtier
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}
