"""Keras-style callbacks: the protocol (`Callback`, `CallbackList`) and the built-in ones."""

from meshfit.callbacks.backup_and_restore import BackupAndRestore
from meshfit.callbacks.csv_logger import CSVLogger
from meshfit.callbacks.early_stopping import EarlyStopping
from meshfit.callbacks.goodput import Goodput, Ledger
from meshfit.callbacks.history import History
from meshfit.callbacks.lambda_callback import LambdaCallback
from meshfit.callbacks.learning_rate_scheduler import LearningRateScheduler
from meshfit.callbacks.model_checkpoint import ModelCheckpoint
from meshfit.callbacks.monitor import MonitorCallback
from meshfit.callbacks.progbar_logger import ProgbarLogger
from meshfit.callbacks.reduce_lr_on_plateau import ReduceLROnPlateau
from meshfit.callbacks.tensorboard import TensorBoard
from meshfit.callbacks.terminate_on_nan import TerminateOnNaN
from meshfit.callbacks.throughput import Throughput
from meshfit.training.callback_protocol import Callback, CallbackList

__all__ = [
    "BackupAndRestore",
    "Callback",
    "CallbackList",
    "CSVLogger",
    "EarlyStopping",
    "Goodput",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "Ledger",
    "ModelCheckpoint",
    "MonitorCallback",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
    "Throughput",
]
