"""Model definitions in plain torch."""
