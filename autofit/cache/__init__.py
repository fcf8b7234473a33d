"""The plan cache and what a run remembers."""
