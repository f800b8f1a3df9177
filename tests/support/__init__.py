"""Helpers for the HTTP, client and CLI tests: a stand-in encoder, engines, a server harness."""
