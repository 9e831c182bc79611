"""Files written and read safely: atomic writes (temporary path, fsync, rename), the per-model
manifest of sizes and SHA-256, and the checks on a safetensors file before MLX reads it."""
