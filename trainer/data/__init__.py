"""Data utilities shared by all tasks (samplers, worker seeding) and the format loaders."""
