"""Developer tools (test fixtures, helpers) that are not part of the serving path."""
