"""Serving: the Triton model code and the front ends that talk to it (e.g. the OpenAI-compatible server)."""
