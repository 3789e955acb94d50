"""A process's place in a job: joining `jax.distributed`, the start-up handshake, signals."""
