"""Std. Serving: the baseline a user would build from plain single-model servers (one Triton model per
LLM, each our engine with one model and prefix caching) and a dispatcher that asks a model for one token
per call and applies the routing policy between calls."""
