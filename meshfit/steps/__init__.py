"""Pure step functions: the built-in steps, a `Model` subclass's own, and the Flax module adapters."""
