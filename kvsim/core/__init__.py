"""The pure KV-cache core: request, prefix keys, block pool, KV cache manager, the scheduler's
decision, the fast-forward horizon, the router, the memory plan. No SimPy, no clock."""
