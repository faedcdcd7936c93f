"""Glue for other libraries' training loops (optional dependencies, imported on use)."""
