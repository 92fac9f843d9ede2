"""kvsim: a discrete-event simulator of LLM-inference clusters centred on the KV cache."""

__version__ = "0.1.0"
