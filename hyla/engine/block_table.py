"""BlockTable: a request's page ids (a list), with an identity and a version the decode graphs'
host staging keys on (hyla.engine.cuda_graph): a row whose table is unchanged since the step
before is not written again, so a decode step's host work does not grow with the context."""

from __future__ import annotations

import itertools

_uids = itertools.count(1)


class BlockTable(list):
    """A list of page ids; `key` = (an id never reused, a count of its changes)."""

    __slots__ = ("uid", "version")

    def __init__(self, pages=()):
        super().__init__(pages)
        self.uid = next(_uids)
        self.version = 0

    def __reduce__(self):
        """Pickled as its pages (a step plan sent to tensor-parallel ranks): a fresh table there."""
        return BlockTable, (list(self),)

    @property
    def key(self) -> tuple[int, int]:
        return self.uid, self.version

    def _changed(self) -> None:
        self.version += 1

    def extend(self, pages) -> None:
        super().extend(pages)
        self._changed()

    def append(self, page) -> None:
        super().append(page)
        self._changed()

    def insert(self, index, page) -> None:
        super().insert(index, page)
        self._changed()

    def pop(self, index=-1):
        self._changed()
        return super().pop(index)

    def remove(self, page) -> None:
        super().remove(page)
        self._changed()

    def clear(self) -> None:
        super().clear()
        self._changed()

    def __setitem__(self, index, value) -> None:
        super().__setitem__(index, value)
        self._changed()

    def __delitem__(self, index) -> None:
        super().__delitem__(index)
        self._changed()

    def __iadd__(self, pages):
        self.extend(pages)
        return self


def table_key(table) -> tuple[int, int] | None:
    """A BlockTable's key; None for any other sequence of page ids (never cached)."""
    return table.key if isinstance(table, BlockTable) else None
