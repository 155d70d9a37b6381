"""Token ids of the pieces of long prompts between special tokens, kept for the next request.

A chat request carries the whole conversation, and the server tokenises all of it again on every
turn: an agent session's 20K-token history costs ~20 ms of encoding a turn on one core (60K: ~60
ms), in the turn's time to first token, although only its last messages are new. A tokenizer
splits its input at special tokens before anything else (tokenizers' added vocabulary, tiktoken's
special-token pattern), and encodes each piece between them on its own: so a prompt's ids are its
pieces' ids with the special tokens' between them, and a piece seen in an earlier turn (a system
message, every earlier message) need not be encoded again. `PieceCache` keeps the ids of recent
pieces (least recently used dropped first, at most `max_chars` characters of pieces held); the
tokenizer encodes only the pieces it misses, in one batch.

Exactness rests on that independence, which each tokenizer checks before it uses a cache
(hyla.models.tokenizer: added tokens that strip whitespace around them, match single words, or
match normalised text make the pieces depend on their neighbours; a pre-tokenizer that treats the
start of the text apart from the rest shows in a probe); tiktoken's encoding is independent by
construction.
"""

from __future__ import annotations

import array
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

MAX_CACHED_CHARS = 16 << 20  # characters of pieces kept (and ~1-4 bytes of ids per 4 of them)
MIN_PIECE_CHARS = 64  # shorter pieces (a role name, a newline) are encoded each time: cheaper than a lookup's bookkeeping


class PieceCache:
    """Recently encoded pieces -> their ids (module docstring)."""

    def __init__(self, max_chars: int = MAX_CACHED_CHARS):
        self.max_chars = max_chars
        self._ids: OrderedDict[str, array.array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # the server may encode on several threads
        self.hits = self.misses = 0

    def encode(self, pieces: list[str], encode_many: Callable[[list[str]], list[list[int]]]) -> list[Sequence[int]]:
        """The ids of each piece, in order: cached ones looked up, the others (and pieces under
        MIN_PIECE_CHARS) encoded by one call of encode_many, the long ones kept. Each piece's ids
        are a sequence of ints the caller reads, not a list it may keep (a cached one is shared)."""
        found: list = [None] * len(pieces)
        with self._lock:
            for i, piece in enumerate(pieces):
                ids = self._ids.get(piece) if len(piece) >= MIN_PIECE_CHARS else None
                if ids is not None:
                    self._ids.move_to_end(piece)
                    found[i] = ids
        missing = [i for i, ids in enumerate(found) if ids is None]
        if missing:
            for i, ids in zip(missing, encode_many([pieces[i] for i in missing])):
                found[i] = ids
        with self._lock:
            self.hits += len(pieces) - len(missing)
            self.misses += len(missing)
            for i in missing:
                piece = pieces[i]
                if MIN_PIECE_CHARS <= len(piece) <= self.max_chars and piece not in self._ids:
                    self._ids[piece] = array.array("l", found[i])
                    self._chars += len(piece)
            while self._chars > self.max_chars:
                piece, _ = self._ids.popitem(last=False)
                self._chars -= len(piece)
        return found
