"""The fleet router: one OpenAI endpoint in front of an InferenceService's engines.

Pure parts (no I/O, no clock of their own, so the simulator can drive them): `endpoints` (the routable
set), `prefix` (block hashing and the per-engine prefix index), `policies` (the routing policies).
I/O parts: `proxy` (the aiohttp server that forwards), `metrics`, `discovery` (EndpointSlice watch),
`cli` (`specfleet router`). See docs/router.md.
"""
