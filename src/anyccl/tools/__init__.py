"""The command-line tools: bench (and, as they land, info and viz)."""
