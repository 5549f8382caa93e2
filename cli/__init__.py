"""The `specfleet` command for the whole distribution: each subcommand owned by the part that implements it."""
