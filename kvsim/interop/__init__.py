"""Other tools' formats: vLLM ``bench serve`` results out (`bench_json`), bench results in
(`against`), and KV events (`kv_events`)."""
