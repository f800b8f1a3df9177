"""Hostile clients against a real ``trio-encode serve`` process (docs/testing.md, "The
hostile-client suite")."""
