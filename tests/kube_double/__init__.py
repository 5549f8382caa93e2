"""The parts of the strict Kubernetes API double (tests/fake_kube.py, which serves them over HTTP):

- `store`: objects, resourceVersions and generations, field managers and server-side apply, deletion with
  finalizers and garbage collection;
- `admission`: RBAC from the chart's own Roles, CRD admission (defaulting, pruning, schema, CEL), the
  built-in kinds it validates (Leases), subresource scoping and owner-reference enforcement;
- `watch`: watch streams and the events each write sends them;
- `wire`: what they share on the wire: Status responses, label selectors, JSON merge patch.
"""
