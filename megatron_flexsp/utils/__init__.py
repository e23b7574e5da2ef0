"""Small stdlib-only helpers (layer 0)."""
