"""cbgen: continuous-batching generation for transformers causal LMs."""
