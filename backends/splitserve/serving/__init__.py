"""Serving logic shared by the Triton adapters, free of Triton imports so it is unit-testable."""
