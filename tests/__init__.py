"""Tests. Fakes (named as such) live in tests/fakes/; product packages never import this."""
