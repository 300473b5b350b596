{{/*
The Prometheus rules kvtier ships: recording rules for the hit rates the alerts and the
dashboard share, and the alerts. One definition, rendered into the plain rules file
(ConfigMap) and into the PrometheusRule. Prometheus' own templates are quoted with
backticks so Helm leaves them alone.
*/}}
{{- define "kvtier.alertRules" -}}
{{- $r := .Values.monitoring.rules -}}
groups:
  - name: kvtier.recording
    rules:
      - record: kvtier:lookups:rate
        expr: sum by (namespace, policy, version) (rate(kvtier_lookups_total[{{ $r.window }}]))
      # The hit rate: prompt tokens the engines loaded from kvtier over the prompt tokens
      # they looked up, as the engines report them (what the operator's gate and
      # `kubectl get kvcp` read too).
      - record: kvtier:hit_rate:ratio
        expr: |-
          sum by (namespace, policy, version) (rate(kvtier_engine_loaded_tokens_total[{{ $r.window }}]))
            / sum by (namespace, policy, version) (rate(kvtier_engine_prompt_tokens_total[{{ $r.window }}]))
      # What the lookups offered (matched tokens over queried): an engine may take less,
      # or nothing, when its own prefix cache holds the prompt. Not a hit rate.
      - record: kvtier:offered_rate:ratio
        expr: |-
          sum by (namespace, policy, version) (rate(kvtier_prefix_cache_hits_total[{{ $r.window }}]))
            / sum by (namespace, policy, version) (rate(kvtier_prefix_cache_queries_total[{{ $r.window }}]))
  - name: kvtier.alerts
    rules:
      - alert: KVTierHitRateDrop
        # A weights version whose hit rate fell below a fraction of the best version of
        # the same policy (during a rollout: the canary against the stable fleet), with
        # enough lookups to mean something.
        expr: |-
          kvtier:hit_rate:ratio
            < on (namespace, policy) group_left ()
              ({{ $r.hitRateDropRatio }} * max by (namespace, policy) (kvtier:hit_rate:ratio))
          and on (namespace, policy, version) kvtier:lookups:rate >= {{ $r.minLookupsPerSecond }}
        for: {{ $r.for }}
        labels:
          severity: warning
        annotations:
          summary: {{ `kvtier hit rate of {{ $labels.version }} dropped ({{ $labels.namespace }}/{{ $labels.policy }})` | quote }}
          description: {{ printf "Version {{ $labels.version }} of policy {{ $labels.namespace }}/{{ $labels.policy }} loads {{ $value | humanizePercentage }} of its prompt tokens from kvtier, below %v x the policy's best version; a rollout gated on this alarm rolls it back." $r.hitRateDropRatio | quote }}
      - alert: KVTierRolloutStalled
        expr: time() - max by (namespace, policy, target_version) (kvtier_rollout_step_started_timestamp_seconds) > {{ $r.rolloutStalledAfterSeconds }}
        labels:
          severity: warning
        annotations:
          summary: {{ `kvtier rollout of {{ $labels.target_version }} stalled ({{ $labels.namespace }}/{{ $labels.policy }})` | quote }}
          description: {{ printf "The rollout step of {{ $labels.namespace }}/{{ $labels.policy }} started {{ $value | humanizeDuration }} ago (more than %vs): it is paused, or its pods neither recover nor fail. See kubectl kvtier status." $r.rolloutStalledAfterSeconds | quote }}
      - alert: KVTierThrashing
        expr: max by (namespace, policy, pod) (kvtier_thrashing) == 1
        for: {{ $r.for }}
        labels:
          severity: warning
        annotations:
          summary: {{ `kvtier DRAM tier of {{ $labels.pod }} is thrashing` | quote }}
          description: {{ `Blocks are evicted before they are reused on {{ $labels.namespace }}/{{ $labels.pod }}; admission is raised. The working set exceeds the tier: add DRAM or replicas.` | quote }}
      - alert: KVTierGlobalIndexDown
        # No sidecar of the policy reaches the global index: peer hits stop (misses, not errors).
        expr: max by (namespace, policy) (kvtier_index_up) == 0
        for: {{ $r.for }}
        labels:
          severity: critical
        annotations:
          summary: {{ `kvtier global index down for {{ $labels.namespace }}/{{ $labels.policy }}` | quote }}
          description: {{ `No sidecar of {{ $labels.namespace }}/{{ $labels.policy }} reaches Redis; the peer tier serves nothing until it returns.` | quote }}
      - alert: KVTierPeerErrors
        expr: |-
          sum by (namespace, policy) (rate(kvtier_peer_errors_total[{{ $r.window }}]))
            / sum by (namespace, policy) (rate(kvtier_peer_fetches_total[{{ $r.window }}]))
            > {{ $r.peerErrorRatio }}
        for: {{ $r.for }}
        labels:
          severity: warning
        annotations:
          summary: {{ `kvtier peer fetches failing for {{ $labels.namespace }}/{{ $labels.policy }}` | quote }}
          description: {{ printf "{{ $value | humanizePercentage }} of peer fetches of {{ $labels.namespace }}/{{ $labels.policy }} end early (above %v): check the peer secret, the network and the pods' logs." $r.peerErrorRatio | quote }}
{{- end -}}
