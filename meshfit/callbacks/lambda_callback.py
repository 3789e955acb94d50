"""`LambdaCallback`: a callback built from plain functions (Keras's `LambdaCallback`)."""

from __future__ import annotations

from meshfit.training.callback_protocol import Callback


class LambdaCallback(Callback):
    """Callback for creating simple, custom callbacks on-the-fly.

    The functions are called with the hook's positional arguments:

    - `on_epoch_begin` and `on_epoch_end`: `epoch, logs`
    - `on_train_begin` and `on_train_end`: `logs`
    - `on_train_batch_begin` and `on_train_batch_end`: `batch, logs`
    - any other hook of `Callback` (`on_test_begin`, `on_predict_batch_end`,
      `on_batch_end`, ...) can be given as a keyword argument and receives
      the same arguments as that hook.

    Example:

    ```python
    batch_print_callback = LambdaCallback(
        on_train_batch_begin=lambda batch, logs: print(batch))
    ```
    """

    def __init__(
        self,
        on_epoch_begin=None,
        on_epoch_end=None,
        on_train_begin=None,
        on_train_end=None,
        on_train_batch_begin=None,
        on_train_batch_end=None,
        **kwargs,
    ):
        super().__init__()
        self.__dict__.update(kwargs)
        if on_epoch_begin is not None:
            self.on_epoch_begin = on_epoch_begin
        if on_epoch_end is not None:
            self.on_epoch_end = on_epoch_end
        if on_train_begin is not None:
            self.on_train_begin = on_train_begin
        if on_train_end is not None:
            self.on_train_end = on_train_end
        if on_train_batch_begin is not None:
            self.on_train_batch_begin = on_train_batch_begin
        if on_train_batch_end is not None:
            self.on_train_batch_end = on_train_batch_end
