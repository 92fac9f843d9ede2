"""The pure KV-cache core: block pool, prefix keys, scheduler decision. No SimPy, no clock."""
