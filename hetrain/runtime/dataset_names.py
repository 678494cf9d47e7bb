"""What the DataLoader holds in place of the script's dataset passes the dataset's own names through."""

from __future__ import annotations

from typing import Any


class ScriptDatasetNames:
    """A wrapper of the script's dataset, kept as `_hetrain_dataset` (its own names start with `_hetrain_`, set
    with object.__setattr__). A worker_init_fn reaches the dataset through get_worker_info().dataset, which is the
    wrapper: every name it reads or sets there (a file handle opened per worker, the dataset's own `seed`) is the
    script's dataset's."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("__", "_hetrain_")):
            raise AttributeError(name)
        return getattr(self._hetrain_dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._hetrain_dataset, name, value)
