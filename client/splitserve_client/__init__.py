"""Splitserve command line and clients (tritonclient gRPC/HTTP)."""
