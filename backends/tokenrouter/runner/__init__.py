"""Model code, weights, paged KV pool, attention backends and the sampler."""
