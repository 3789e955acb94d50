"""`TerminateOnNaN`: stops training at the first NaN or Inf loss (Keras's `TerminateOnNaN`)."""

from __future__ import annotations

import numpy as np

from meshfit.callbacks.console import print_msg
from meshfit.training.callback_protocol import Callback


class TerminateOnNaN(Callback):
    """Callback that terminates training when a NaN or Inf loss is encountered.

    The loss of every training batch is checked (this reads the on-device loss
    of each batch, as Keras does). By default training stops gracefully with
    `model.stop_training = True`, so `on_train_end()` of every callback runs;
    with `raise_error=True` a `RuntimeError` is raised immediately instead.

    Args:
        raise_error: if True, raise `RuntimeError` on a NaN/Inf loss instead of
            stopping gracefully.
    """

    def __init__(self, raise_error: bool = False):
        super().__init__()
        self.raise_error = raise_error

    def on_batch_end(self, batch, logs=None):
        logs = logs or {}
        loss = logs.get("loss")
        if loss is not None:
            loss = np.asarray(loss)
            if np.isnan(loss) or np.isinf(loss):
                if self.raise_error:
                    raise RuntimeError(
                        f"NaN or Inf loss encountered at batch {batch}. "
                        f"Loss value: {loss}. Terminating training immediately."
                    )
                print_msg(f"Batch {batch}: Invalid loss, terminating training")
                self.model.stop_training = True
