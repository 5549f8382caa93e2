"""Prefill/decode disaggregation: a KV connector moves a prompt's paged KV blocks from a prefill engine
to a decode engine (docs/architecture.md, "KV connector"). `base` and `wire` import no torch (the fleet's
proxy uses them); `blocks`, `zmq_transport` and `connector` are the engine's side."""
