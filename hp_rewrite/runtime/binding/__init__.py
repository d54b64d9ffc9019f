"""A holder made expert-parallel: its binding, installed once."""
