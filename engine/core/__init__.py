"""The engine core in its own process (vLLM V1's split): `proc` runs the scheduler and the model, `client`
starts it and talks to it from the server, `output_processor` turns its token deltas into text."""
