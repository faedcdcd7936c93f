"""Op rules grouped by family; hyper_parallel/ops/yaml/*.yaml maps op names to them."""
