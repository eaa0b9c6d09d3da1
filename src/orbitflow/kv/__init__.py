"""Two-tier paged KV cache: block pools per tier, the layer-aware block table, the transfer engine, the KV manager."""
