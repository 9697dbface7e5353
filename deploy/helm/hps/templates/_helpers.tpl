{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "hps.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name; StatefulSet pod names append "-N", so keep room under 63. */}}
{{- define "hps.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "hps.headlessName" -}}
{{- printf "%s-headless" (include "hps.fullname" .) }}
{{- end }}

{{- define "hps.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hps.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hps.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "hps.labels" -}}
helm.sh/chart: {{ include "hps.chart" . }}
{{ include "hps.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: server
{{- end }}

{{- define "hps.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hps.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image: pinned by image.digest when given, else an explicit tag, else appVersion (+ "-cuda" for GPU pods). */}}
{{- define "hps.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- $suffix := ternary "-cuda" "" .Values.gpu.enabled }}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion $suffix) }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{- define "hps.adminSecretName" -}}
{{- .Values.adminToken.existingSecret | default (printf "%s-admin" (include "hps.fullname" .)) }}
{{- end }}

{{/* Whether the server gets an admin token: from adminToken.existingSecret, or adminToken.value (a chart Secret). */}}
{{- define "hps.adminEnabled" -}}
{{- if or .Values.adminToken.existingSecret .Values.adminToken.value }}true{{ end }}
{{- end }}

{{/* Whether the server speaks TLS: config.server.tls given as paths, or tls.existingSecret mounted. */}}
{{- define "hps.tlsEnabled" -}}
{{- if or .Values.config.server.tls .Values.tls.existingSecret }}true{{ end }}
{{- end }}

{{/* Where the secrets are mounted as files (the server reads each *_file key's file, and again when it changes). */}}
{{- define "hps.secretsDir" -}}/etc/hps/secrets{{- end }}
{{- define "hps.tlsDir" -}}/etc/hps/tls{{- end }}

{{/*
The projected sources of the secrets volume: the admin token, the read tokens (one key per reader), the admin key of
the update topics. Empty when there is none.
*/}}
{{- define "hps.secretSources" -}}
{{- if include "hps.adminEnabled" . }}
- secret:
    name: {{ include "hps.adminSecretName" . }}
    items:
      - {key: {{ .Values.adminToken.key }}, path: admin-token}
{{- end }}
{{- if and (eq .Values.auth.mode "token") .Values.auth.readers }}
- secret:
    name: {{ required "auth.existingSecret (one key per reader, its token) is required with auth.mode token" .Values.auth.existingSecret }}
    items:
      {{- range .Values.auth.readers }}
      - {key: {{ .name }}, path: readers/{{ .name }}}
      {{- end }}
{{- end }}
{{- if .Values.kafka.adminKey.existingSecret }}
- secret:
    name: {{ .Values.kafka.adminKey.existingSecret }}
    items:
      - {key: {{ .Values.kafka.adminKey.key }}, path: admin-key}
{{- end }}
{{- end }}

{{/*
Secrets never go into the ConfigMap: refuse values that would put one there, naming where it belongs.
*/}}
{{- define "hps.checkNoSecretsInConfig" -}}
{{- $cfg := .Values.config }}
{{- if and $cfg.server (hasKey $cfg.server "admin_token") }}
{{- fail "config.server.admin_token would land in the ConfigMap: set adminToken.existingSecret (or adminToken.value)" }}
{{- end }}
{{- if and $cfg.volatile (hasKey $cfg.volatile "password") }}
{{- fail "config.volatile.password would land in the ConfigMap: set redisCluster.existingSecret" }}
{{- end }}
{{- if and $cfg.updates (hasKey $cfg.updates "sasl_password") }}
{{- fail "config.updates.sasl_password would land in the ConfigMap: set kafka.sasl.existingSecret" }}
{{- end }}
{{- if and $cfg.updates (hasKey $cfg.updates "admin_key") }}
{{- fail "config.updates.admin_key would land in the ConfigMap: set kafka.adminKey.existingSecret" }}
{{- end }}
{{- range (($cfg.server | default dict).readers | default list) }}
{{- if hasKey . "token" }}
{{- fail "config.server.readers[].token would land in the ConfigMap: set auth.readers and auth.existingSecret" }}
{{- end }}
{{- end }}
{{- range $key, $_ := (($cfg.updates | default dict).kafka_config | default dict) }}
{{- if or (hasSuffix "password" $key) (hasSuffix ".pem" $key) (eq $key "sasl.oauthbearer.client.secret") }}
{{- fail (printf "config.updates.kafka_config.%s would land in the ConfigMap: set kafka.sasl.existingSecret" $key) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "hps.consumerGroupPrefix" -}}
{{- .Values.kafka.consumerGroupPrefix | default (printf "hps.%s.%s" .Release.Namespace (include "hps.fullname" .)) }}
{{- end }}

{{/*
The server's config as YAML: .Values.config with the redisCluster and kafka switches applied.
The consumer group and the secrets come from the environment (see the StatefulSet).
*/}}
{{- define "hps.serverConfig" -}}
{{- include "hps.checkNoSecretsInConfig" . }}
{{- $cfg := deepCopy .Values.config }}
{{- if .Values.redisCluster.enabled }}
{{- /* volatile is one backend's settings: the hash map's own keys do not go with redis_cluster */}}
{{- $volatile := omit (deepCopy ($cfg.volatile | default dict)) "capacity_rows" "capacity_mb" "overflow_policy" "overflow_evict_fraction" }}
{{- $volatile = mergeOverwrite $volatile (dict "type" "redis_cluster" "nodes" .Values.redisCluster.nodes) }}
{{- $_ := set $cfg "volatile" $volatile }}
{{- end }}
{{- $serverCfg := deepCopy $cfg.server }}
{{- if .Values.tls.existingSecret }}
{{- $tls := dict "cert_file" (printf "%s/tls.crt" (include "hps.tlsDir" .)) "key_file" (printf "%s/tls.key" (include "hps.tlsDir" .)) }}
{{- if .Values.tls.clientAuth }}
{{- $_ := set $tls "client_ca_file" (printf "%s/ca.crt" (include "hps.tlsDir" .)) }}
{{- end }}
{{- $_ := set $serverCfg "tls" $tls }}
{{- end }}
{{- if include "hps.tlsEnabled" . }}
{{- $_ := set $serverCfg "probe_port" (include "hps.probePort" . | int) }}
{{- end }}
{{- if include "hps.adminEnabled" . }}
{{- $_ := set $serverCfg "admin_token_file" (printf "%s/admin-token" (include "hps.secretsDir" .)) }}
{{- end }}
{{- if ne .Values.auth.mode "none" }}
{{- $readers := list }}
{{- range .Values.auth.readers }}
{{- $reader := deepCopy . }}
{{- if eq $.Values.auth.mode "token" }}
{{- $_ := set $reader "token_file" (printf "%s/readers/%s" (include "hps.secretsDir" $) .name) }}
{{- end }}
{{- $readers = append $readers $reader }}
{{- end }}
{{- $_ := set $serverCfg "auth" .Values.auth.mode }}
{{- $_ := set $serverCfg "readers" $readers }}
{{- end }}
{{- $local := $serverCfg.local | default dict }}
{{- if and $local.enabled (not (hasKey $local "group")) .Values.podSecurityContext.fsGroup }}
{{- $_ := set $serverCfg "local" (merge (dict "group" (int .Values.podSecurityContext.fsGroup)) $local) }}
{{- end }}
{{- $_ := set $cfg "server" $serverCfg }}
{{- with .Values.snapshots.store }}
{{- $persistent := mergeOverwrite (deepCopy ($cfg.persistent | default dict)) (dict "snapshot_store" . "snapshot_interval_s" $.Values.snapshots.intervalSeconds "snapshot_retain" $.Values.snapshots.retain) }}
{{- $_ := set $cfg "persistent" $persistent }}
{{- end }}
{{- if .Values.kafka.enabled }}
{{- $updates := mergeOverwrite (deepCopy ($cfg.updates | default dict)) (dict "type" "kafka" "brokers" (join "," .Values.kafka.brokers) "topic_prefix" .Values.kafka.topicPrefix) }}
{{- if .Values.kafka.adminKey.existingSecret }}
{{- $_ := set $updates "admin_key_file" (printf "%s/admin-key" (include "hps.secretsDir" .)) }}
{{- end }}
{{- with .Values.kafka.sasl }}
{{- if .existingSecret }}
{{- $client := deepCopy ($updates.kafka_config | default dict) }}
{{- $_ := set $client "security.protocol" .securityProtocol }}
{{- $_ := set $client "sasl.mechanism" .mechanism }}
{{- $_ := set $updates "kafka_config" $client }}
{{- end }}
{{- end }}
{{- $_ := set $cfg "updates" $updates }}
{{- end }}
{{- if gt (int .Values.shards) 1 }}
{{- $cluster := deepCopy ($cfg.cluster | default dict) }}
{{- $_ := set $cluster "shards" (int .Values.shards) }}
{{- $_ := set $cfg "cluster" $cluster }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
Sharding (README "Sharding"): with shards > 1 every shard gets its own StatefulSet "<fullname>-shard-<i>" and
headless Service "<fullname>-shard-<i>-headless"; its pods are labelled hps/shard=<i> and told their shard by
HPS_CLUSTER__SHARD. With shards: 1 the names and selectors are those of an unsharded release.
The templates that render one object per shard call these with a context of .Values, .Release, .Chart,
.Capabilities, .Template and .Shard.
*/}}
{{- define "hps.sharded" -}}
{{- if gt (int .Values.shards) 1 }}true{{ end }}
{{- end }}

{{/* Fails the render when the shards cannot split config.cluster.partitions (the server would refuse to start). */}}
{{- define "hps.checkShards" -}}
{{- $shards := int .Values.shards }}
{{- $partitions := int ((.Values.config.cluster | default dict).partitions | default 24) }}
{{- if lt $shards 1 }}
{{- fail (printf "shards must be >= 1, got %d" $shards) }}
{{- end }}
{{- if ne (mod $partitions $shards) 0 }}
{{- fail (printf "config.cluster.partitions (%d) must be a multiple of shards (%d)" $partitions $shards) }}
{{- end }}
{{- end }}

{{- define "hps.shardName" -}}
{{- if include "hps.sharded" . }}
{{- printf "%s-shard-%d" (include "hps.fullname" . | trunc 43 | trimSuffix "-") (int .Shard) }}
{{- else }}
{{- include "hps.fullname" . }}
{{- end }}
{{- end }}

{{- define "hps.shardHeadlessName" -}}
{{- if include "hps.sharded" . }}
{{- printf "%s-headless" (include "hps.shardName" .) }}
{{- else }}
{{- include "hps.headlessName" . }}
{{- end }}
{{- end }}

{{- define "hps.shardLabels" -}}
{{ include "hps.labels" . }}
{{- if include "hps.sharded" . }}
hps/shard: {{ .Shard | quote }}
{{- end }}
{{- end }}

{{- define "hps.shardSelectorLabels" -}}
{{ include "hps.selectorLabels" . }}
{{- if include "hps.sharded" . }}
hps/shard: {{ .Shard | quote }}
{{- end }}
{{- end }}

{{/* Pods per shard: replicasPerShard, else replicaCount. */}}
{{- define "hps.replicasPerShard" -}}
{{- if kindIs "invalid" .Values.replicasPerShard }}{{ .Values.replicaCount }}{{ else }}{{ .Values.replicasPerShard }}{{ end }}
{{- end }}

{{/* The pod's shard, for the server (HPS_CLUSTER__SHARD) and hps import; nothing when unsharded. */}}
{{- define "hps.shardEnv" -}}
{{- if include "hps.sharded" . }}
- name: HPS_CLUSTER__SHARD
  value: {{ .Shard | quote }}
{{- end }}
{{- end }}

{{/* The gRPC targets a client takes: one dns:/// name per shard (each shard's headless Service). */}}
{{- define "hps.clientTargets" -}}
{{- $targets := list }}
{{- range $i := until (int .Values.shards) }}
{{- $ctx := dict "Values" $.Values "Release" $.Release "Chart" $.Chart "Shard" $i }}
{{- $targets = append $targets (printf "dns:///%s.%s.svc:%d" (include "hps.shardHeadlessName" $ctx) $.Release.Namespace (int $.Values.config.server.grpc_port)) }}
{{- end }}
{{- toJson $targets }}
{{- end }}

{{/* Seconds the pod may take to stop: preStop sleep + the server's drain period + a margin. */}}
{{- define "hps.terminationGracePeriod" -}}
{{- $drain := .Values.config.server.grace_period_s | default 30 | float64 | ceil | int }}
{{- add (int .Values.termination.preStopSleepSeconds) $drain (int .Values.termination.extraGraceSeconds) }}
{{- end }}

{{/* TCP ports of "host:port" entries, deduplicated. */}}
{{- define "hps.endpointPorts" -}}
{{- $ports := list }}
{{- range . }}
{{- $ports = append $ports (splitList ":" . | last | int) }}
{{- end }}
{{- toJson ($ports | uniq) }}
{{- end }}

{{/* Container environment: per-pod consumer group, the Redis and SASL credentials, JIT cache on the writable /tmp
(the admin token, read tokens and admin key are files: see hps.secretSources). */}}
{{- define "hps.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: HPS_UPDATES__GROUP
  value: {{ printf "%s.$(POD_NAME)" (include "hps.consumerGroupPrefix" .) | quote }}
{{- if and .Values.redisCluster.enabled .Values.redisCluster.existingSecret }}
{{- if .Values.redisCluster.usernameKey }}
- name: HPS_VOLATILE__USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redisCluster.existingSecret }}
      key: {{ .Values.redisCluster.usernameKey }}
{{- end }}
- name: HPS_VOLATILE__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redisCluster.existingSecret }}
      key: {{ .Values.redisCluster.passwordKey }}
{{- end }}
{{- if and .Values.kafka.enabled .Values.kafka.sasl.existingSecret }}
- name: HPS_UPDATES__SASL_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.sasl.existingSecret }}
      key: {{ .Values.kafka.sasl.usernameKey }}
- name: HPS_UPDATES__SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.kafka.sasl.existingSecret }}
      key: {{ .Values.kafka.sasl.passwordKey }}
{{- end }}
- name: NUMBA_CACHE_DIR
  value: /tmp/numba
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "hps.volumeMounts" -}}
- name: config
  mountPath: /etc/hps
  readOnly: true
- name: data
  mountPath: {{ include "hps.dataPath" . }}
- name: tmp
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
{{- if include "hps.secretSources" . }}
- name: secrets
  mountPath: {{ include "hps.secretsDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.tls.existingSecret }}
- name: tls
  mountPath: {{ include "hps.tlsDir" . }}
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Where the per-pod data volume is mounted (persistence.mountPath). RocksDB (config.persistent.path) and
RocksDB snapshots (config.server.snapshots_path, by default next to it) must live on it: the root
filesystem is read-only.
*/}}
{{- define "hps.dataPath" -}}
{{- $mount := .Values.persistence.mountPath | default "/var/lib/hps" | trimSuffix "/" }}
{{- $path := .Values.config.persistent.path | default "/var/lib/hps/rocksdb" | toString }}
{{- if not (hasPrefix (printf "%s/" $mount) $path) }}
{{- fail (printf "config.persistent.path %q must be an absolute path inside persistence.mountPath %q" $path $mount) }}
{{- end }}
{{- with .Values.config.server.snapshots_path }}
{{- if not (hasPrefix (printf "%s/" $mount) (toString .)) }}
{{- fail (printf "config.server.snapshots_path %q must be inside persistence.mountPath %q" (toString .) $mount) }}
{{- end }}
{{- end }}
{{- $mount }}
{{- end }}

{{/* The plaintext probe port the server opens under TLS (config.server.probe_port, else probes.plaintextPort). */}}
{{- define "hps.probePort" -}}
{{- .Values.config.server.probe_port | default .Values.probes.plaintextPort | int }}
{{- end }}
