"""``python -m validate``: a small real serving loop driven by kvsim's pure scheduler (torch; a child
process of ``kvsim validate``, which never imports torch itself)."""
