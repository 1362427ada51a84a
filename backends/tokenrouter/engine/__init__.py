"""Request state, scheduler, block accounting and the in-process Engine."""
