"""Edge runtime: a model's first layers on the device (see issue 7; not built yet)."""
