"""Acceptance rules, kept apart from the proposers (as in vLLM v1)."""
