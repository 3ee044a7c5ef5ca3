"""mmfeatd: the per-node daemon that owns the feature pools. Never imports torch."""
