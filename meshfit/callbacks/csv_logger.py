"""`CSVLogger`: streams epoch results to a CSV file (Keras's `CSVLogger`, same format)."""

from __future__ import annotations

import collections
import collections.abc
import csv
import os

import numpy as np

from meshfit.callbacks.console import is_chief
from meshfit.training.callback_protocol import Callback


class CSVLogger(Callback):
    """Callback that streams epoch results to a CSV file.

    Supports all values that can be represented as a string, including 1D
    iterables such as `np.ndarray`. The header is `epoch` followed by the
    sorted keys of the first epoch's logs; as in Keras 3, when those logs have
    no `val_` key, a `val_<key>` column is added for each key (filled with
    `NA` while there is no validation). Only process 0 writes.

    Args:
        filename: filename of the CSV file, e.g. `"run/log.csv"`.
        separator: string used to separate elements in the CSV file.
        append: True: append if the file exists (useful for continuing
            training; no second header is written). False: overwrite.
    """

    def __init__(self, filename, separator=",", append=False):
        super().__init__()
        self.sep = separator
        self.filename = os.fspath(filename)
        self.append = append
        self.writer = None
        self.keys = None
        self.append_header = True
        self.csv_file = None

    def on_train_begin(self, logs=None):
        if not is_chief():
            return
        if self.append:
            if os.path.exists(self.filename):
                with open(self.filename) as f:
                    self.append_header = not bool(len(f.readline()))
            mode = "a"
        else:
            mode = "w"
        # ensure csv_file is None or closed before reassigning
        if self.csv_file and not self.csv_file.closed:
            self.csv_file.close()
        self.csv_file = open(self.filename, mode, newline="")
        # Reset writer and keys
        self.writer = None
        self.keys = None

    def on_epoch_end(self, epoch, logs=None):
        if self.csv_file is None or self.csv_file.closed:
            return
        logs = logs or {}

        def handle_value(k):
            is_zero_dim_ndarray = isinstance(k, np.ndarray) and k.ndim == 0
            if isinstance(k, str):
                return k
            elif isinstance(k, collections.abc.Iterable) and not is_zero_dim_ndarray:
                return f'"[{", ".join(map(str, k))}]"'
            else:
                return k

        if self.keys is None:
            self.keys = sorted(logs.keys())

            val_keys_found = False
            for key in self.keys:
                if key.startswith("val_"):
                    val_keys_found = True
                    break
            if not val_keys_found and self.keys:
                self.keys.extend([f"val_{k}" for k in self.keys])

        if not self.writer:

            class CustomDialect(csv.excel):
                delimiter = self.sep

            fieldnames = ["epoch"] + (self.keys or [])

            self.writer = csv.DictWriter(self.csv_file, fieldnames=fieldnames, dialect=CustomDialect)
            if self.append_header:
                self.writer.writeheader()

        row_dict = collections.OrderedDict({"epoch": epoch})
        row_dict.update((key, handle_value(logs.get(key, "NA"))) for key in self.keys)
        self.writer.writerow(row_dict)
        self.csv_file.flush()

    def on_train_end(self, logs=None):
        if self.csv_file and not self.csv_file.closed:
            self.csv_file.close()
        self.writer = None
