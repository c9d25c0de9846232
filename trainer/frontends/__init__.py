"""Front ends: the Python APIs a model family's users know (ComFormer's, GEARS'), written over `trainer.api`.

They sit above the core and the families in the import graph: a front end builds a config for a family's
task and trains it through the launch API, and calls the family's own functions through the registry
(`trainer.registry.get_family`), never by module name; nothing under `trainer/families` imports `trainer.api` or
`trainer.core` (both tested in tests/contract/test_registry.py). Their public names are listed in trainer/api.py.
Importing this package imports no front end (each pulls in the launch API on import, its family on first use)."""
