"""The loop, the session that owns a fit's state and programs, and how batches reach the devices."""
