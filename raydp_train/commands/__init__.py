"""The `raydp-train` command line, thin over the Python API (api.py)."""
