"""The pieces every layer shares: the batch, the training state, dtype policies, pytree helpers."""
