"""Routing: the policy interface (policy.py) and the built-in policies (policies/)."""
