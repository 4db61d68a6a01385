"""Differential conformance matrix: the same scenario under torch's FSDP and fullshard (issue 23)."""
