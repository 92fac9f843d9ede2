"""Typed results: the run summary and the run directory's files."""
