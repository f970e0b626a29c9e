"""Device side: KV cache, paged attention, input packing, model execution and loading."""
