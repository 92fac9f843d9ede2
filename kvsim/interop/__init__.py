"""Other tools' formats: vLLM ``bench serve`` results out (`bench_json`), bench results in
(`against`); KV events are written by `kvsim.sim.kv_events`."""
