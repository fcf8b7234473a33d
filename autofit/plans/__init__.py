"""The plan, the precisions and the ladder of moves."""
