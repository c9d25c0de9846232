"""Model definitions (single-device; no distributed code)."""
