"""Test doubles and helpers: fakes for what cannot run here, never imported by product code."""
