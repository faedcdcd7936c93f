"""Tools: the operator census (`hyper-parallel census`), its CLI, and built-in tiny models."""
