"""Checkpoint directories on Orbax, what they hold, and the files a job trusts."""
