"""The local fleet behind `specfleet up`: engine processes (supervisor), one load-balancing endpoint (proxy),
and the tuner wired to them."""
