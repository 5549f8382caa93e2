{{- define "specfleet.name" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specfleet.labels" -}}
app.kubernetes.io/name: specfleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "specfleet.selectorLabels" -}}
app.kubernetes.io/name: specfleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specfleet.name" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Namespaces to watch when not cluster-wide: the list, or the release namespace. */}}
{{- define "specfleet.watchNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- join "," .Values.watch.namespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* What the reconcile needs in a watched namespace. No wildcards; no delete except for PDBs it prunes. */}}
{{- define "specfleet.operatorRules" -}}
- apiGroups: ["serving.specfleet.io"]
  resources: ["inferenceservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.specfleet.io"]
  resources: ["inferenceservices/status"]
  verbs: ["get", "patch", "update"]
# Children carry blockOwnerDeletion owner references, which clusters with the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters) allow only to
# users who may update the owner's finalizers.
- apiGroups: ["serving.specfleet.io"]
  resources: ["inferenceservices/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# engine.nodes > 1: the engines as a LeaderWorkerSet (lws.sigs.k8s.io, when its controller is installed)
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# list/watch on every kind of child but the Secret: the operator watches its own children (label-selected
# by the API server: app.kubernetes.io/managed-by=specfleet-operator) and repairs a deleted or hand-edited
# one at its event. RBAC cannot narrow a list by label, and listing Secrets reads every token in the
# namespace: the admin Secret is checked at the resync instead (resyncIntervalSeconds).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
# The tuner's config in force, NAME-tuned, which new engine pods start on (deleted with autotune off).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The router per InferenceService: its Service, ServiceAccount and a Role to read the engines'
# EndpointSlices (the operator must hold what the Role grants to create it), deleted with routing off.
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
# routing.mode endpoint-picker: the Gateway API Inference Extension's InferencePool and, with a gateway named,
# an HTTPRoute (when their CRDs are installed), deleted when the mode changes.
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
# Watched whether or not the operator writes them (its watches are registered when it starts): read-only.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "watch"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["list", "watch"]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- if .Values.serviceMonitor.enabled }}
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- end -}}
