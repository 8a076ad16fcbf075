"""Triton Python-backend adapters: the only modules that import ``triton_python_backend_utils``.

Each ``deploy/templates/<name>/1/model.py`` re-exports one class from here.
"""
