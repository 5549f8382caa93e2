-- Argo CD health check for serving.specfleet.io/InferenceService (Lua 5.1, as Argo CD's gopher-lua runs it).
-- Installed as resource.customizations.health.serving.specfleet.io_InferenceService (see argocd-cm.yaml).
-- Decides from the operator's own conditions (docs/operator.md, "The reconcile"):
--   Ready        True once the rollout is complete (AllReplicasReady); ScaledToZero at zero engines
--   Progressing  True while a rollout runs (RollingOut, Creating)
--   Degraded     True on InvalidSpec, ProgressDeadlineExceeded, ReplicaFailure, a refused child
-- A status older than the spec (status.observedGeneration or Ready's observedGeneration below
-- metadata.generation) is never reported Healthy. The tuner's Tuned condition is informational only:
-- a tuner holding its config (fail static) does not make a serving service unhealthy.
local hs = {}

local function find(conditions, kind)
  for _, c in ipairs(conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function describe(c)
  local text = c.reason or ""
  if c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

if obj.metadata.deletionTimestamp ~= nil then
  hs.status = "Progressing"
  hs.message = "Deleting: waiting for the engine pods to drain."
  return hs
end

if obj.status == nil or obj.status.conditions == nil or #obj.status.conditions == 0 then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status."
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  local seen = "status has no observedGeneration"
  if observed ~= nil then
    seen = "status is from generation " .. observed
  end
  hs.message = "Waiting for the operator to observe generation " .. generation .. " (" .. seen .. ")."
  return hs
end

local conditions = obj.status.conditions
local degraded = find(conditions, "Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded)
  return hs
end

local ready = find(conditions, "Ready")
if ready == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ready condition."
  return hs
end
if generation ~= nil and ready.observedGeneration ~= nil and ready.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Ready is from generation " .. ready.observedGeneration .. "; waiting for generation " .. generation .. "."
  return hs
end

-- A rollout first: scaling down to zero is Progressing until the last engine pod is gone.
local progressing = find(conditions, "Progressing")
if progressing ~= nil and progressing.status == "True" then
  hs.status = "Progressing"
  hs.message = describe(progressing)
  return hs
end

-- Zero engines is the operator's verdict (Ready=False/ScaledToZero), not spec.replicas: with autoscaling the
-- count is the tuner's, clamped to minReplicas (spec.replicas 0 with minReplicas 1 runs one engine), and a
-- tuner at minReplicas 0 scales a spec.replicas of 1 to zero.
if ready.reason == "ScaledToZero" then
  hs.status = "Suspended"
  hs.message = "Scaled to zero replicas: " .. describe(ready)
  return hs
end

if ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end

hs.status = "Progressing"
hs.message = describe(ready)
return hs
