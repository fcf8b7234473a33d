"""One global step under a plan, and the attempts that make it fit."""
