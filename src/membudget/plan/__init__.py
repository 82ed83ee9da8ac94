"""Static memory planning: operator order (tensor lifetimes) and arena offsets (locations)."""
