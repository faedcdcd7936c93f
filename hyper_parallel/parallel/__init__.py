"""Parallelisms built on DTensor layouts: tensor parallel (shard) and hybrid sharded data parallel (hsdp)."""
