"""Tooling for tests and scripts: random-weight checkpoints, stub lookups. No runtime module
imports it."""
