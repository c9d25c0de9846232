"""Model families: one package each, found by name through `trainer.registry` (never imported by the core)."""
