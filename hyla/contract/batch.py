"""ForwardBatch: what one engine step asks of the model and of every layer (hyla.contract).

N sequences each bring some new tokens, packed along one axis of T_total tokens. The model reads
and writes the engine's pools through two indirections only:
- `block_tables[n]`: the KV pages of sequence n (attention layers; page_size tokens per page);
- `state_slots[n]`: the slot of sequence n in every linear layer's state pool.
Pools are allocated by `model.allocate_cache`; who owns which page / slot is the engine's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hyla.ops import constants
from hyla.ops.transfer import long_tensor, stage_long
from hyla.ops.utils import remember_host_values


@dataclass
class ForwardBatch:
    """One engine step: N sequences, their new tokens packed along one axis (T_total).

    cu_seqlens: [N+1] int64, new tokens of sequence n are [cu[n], cu[n+1]).
    context_lens: [N] int64, tokens of sequence n already cached (KV + state) before this step.
    positions: [T_total] int64, absolute position of every new token (context_lens[n] + i).
    block_tables: [N, max_pages] int64, page ids covering positions 0..context_len+new-1 (unused = -1).
    num_accepted_tokens / rollback: speculative verify (see `is_verify`). With rollback "slots",
        state_slots is [N, 1+num_spec]: sequence n starts from slot [n, num_accepted_tokens[n] - 1]
        and the state (and conv windows) after its j-th new token go to slot [n, j]. With
        "replay", only slot [n, num_accepted_tokens[n] - 1] is read, nothing is written, and the
        per-token inputs are kept so that `model.commit_replay` can advance the state by the
        accepted tokens afterwards.
    state_slots: [N] int64, slot of sequence n in every linear layer's pool: read as the initial
        state when context_lens[n] > 0 (zeros otherwise), overwritten with the state after this
        step's tokens.
    checkpoints: per sequence, (p, dest_slot) pairs with 0 < p <= new tokens: after the step, pool
        slot dest_slot holds every linear layer's recurrent state AND conv windows after the first
        p new tokens of this step. dest_slot must not be any sequence's state_slot in this step.
    seq_lens / context_lens_list: the same counts as python lists; pass them to avoid device
        syncs (they are read from the tensors when omitted).
    cuda_graph: a decode / verify batch of the CUDA-graph runners (hyla.engine.cuda_graph,
        cuda_graph_verify): its tensors are persistent buffers refilled before every replay, so
        layers read lengths from the tensors only (context_lens_list is a placeholder), attend over every block_tables column
        (masked), check no values (a check would sync) and let padding rows (slot -1, pages -1)
        write the pools' last slot / page, which the runner keeps as scratch.
    """

    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    positions: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    checkpoints: list[list[tuple[int, int]]] | None = None
    num_accepted_tokens: torch.Tensor | None = None
    rollback: str = "slots"
    seq_lens: list[int] | None = None
    context_lens_list: list[int] | None = None
    cuda_graph: bool = False
    _memo: dict = field(default_factory=dict, repr=False, compare=False)
    _grid: tuple | None = field(default=None, repr=False, compare=False)  # (grid batch, j) of a `column`

    def __post_init__(self):
        n = self.context_lens.shape[0] if self.context_lens.ndim == 1 else -1
        if self.cu_seqlens.ndim != 1 or self.cu_seqlens.shape[0] != n + 1:
            raise ValueError(
                f"cu_seqlens must be [N+1] for N={n} sequences, got {tuple(self.cu_seqlens.shape)}"
            )
        if self.seq_lens is None:
            self.seq_lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        if self.context_lens_list is None:
            self.context_lens_list = self.context_lens.tolist()
        if len(self.seq_lens) != n or len(self.context_lens_list) != n:
            raise ValueError(f"seq_lens / context_lens_list must have N={n} entries")
        if any(s < 0 for s in self.seq_lens) or any(c < 0 for c in self.context_lens_list):
            raise ValueError("new-token counts and context lengths must be >= 0")
        t = sum(self.seq_lens)
        if self.positions.shape != (t,):
            raise ValueError(f"positions must be [T_total={t}], got {tuple(self.positions.shape)}")
        if self.block_tables.ndim != 2 or self.block_tables.shape[0] != n:
            raise ValueError(f"block_tables must be [N={n}, max_pages], got {tuple(self.block_tables.shape)}")
        if self.num_accepted_tokens is None and self.state_slots.shape != (n,):
            raise ValueError(f"state_slots must be [N={n}], got {tuple(self.state_slots.shape)}")
        if self.num_accepted_tokens is not None:
            if self.rollback not in ("slots", "replay"):
                raise ValueError(f"rollback must be 'slots' or 'replay', got {self.rollback!r}")
            if self.state_slots.ndim != 2 or self.state_slots.shape[0] != n:
                raise ValueError(f"verify needs state_slots [N={n}, 1+num_spec], got {tuple(self.state_slots.shape)}")
            if self.num_accepted_tokens.shape != (n,):
                raise ValueError(f"num_accepted_tokens must be [N={n}], got {tuple(self.num_accepted_tokens.shape)}")
            if self.rollback == "slots" and any(s > self.state_slots.shape[1] for s in self.seq_lens):
                raise ValueError("a sequence verifies more tokens than it has state slots")
            if any(c == 0 for c in self.context_lens_list):
                raise ValueError("speculative verify needs every sequence to have context (a prefilled prompt)")
        if self.checkpoints is not None:
            if len(self.checkpoints) != n:
                raise ValueError(f"checkpoints must have one list per sequence (N={n}), got {len(self.checkpoints)}")
            for i, (pairs, new) in enumerate(zip(self.checkpoints, self.seq_lens)):
                for p, _ in pairs:
                    if not 0 < p <= new:
                        raise ValueError(f"checkpoint position {p} of sequence {i} is outside 1..{new}")

    @classmethod
    def build(cls, seq_lens: list[int], context_lens: list[int], block_tables, state_slots,
              checkpoints=None, device=None, num_accepted_tokens=None, rollback: str = "slots") -> ForwardBatch:
        """Build from python lists: new tokens and cached tokens per sequence; block_tables as a
        list of page-id lists (ragged, padded with -1) or a tensor; state_slots as a list or tensor."""
        cu = [0]
        for s in seq_lens:
            cu.append(cu[-1] + s)
        n, total = len(seq_lens), cu[-1]
        # positions[cu[i] + j] = context_lens[i] + j, built with tensor ops (not per token in python)
        host_lens = long_tensor(seq_lens)
        positions = (torch.arange(total, dtype=torch.long)
                     + torch.repeat_interleave(long_tensor(context_lens) - long_tensor(cu[:-1]), host_lens,
                                               output_size=total)) if total else torch.empty(0, dtype=torch.long)
        host_tables = None
        if not isinstance(block_tables, torch.Tensor):
            width = max((len(b) for b in block_tables), default=0)
            host_tables = [list(b) + [-1] * (width - len(b)) for b in block_tables]
            block_tables = long_tensor([p for row in host_tables for p in row]).reshape(n, width)
        # every host-built piece reaches the device in one pinned transfer (hyla.contract.host);
        # tensors already on the device are used as they are
        pieces = {"cu": cu, "ctx": list(context_lens), "pos": positions, "tables": block_tables,
                  "slots": state_slots, "accepted": num_accepted_tokens}
        staged = {k: v for k, v in pieces.items() if v is not None and not (isinstance(v, torch.Tensor)
                                                                             and v.device.type != "cpu")}
        dev = dict(zip(staged, stage_long(list(staged.values()), device)))

        def placed(key):
            v = dev.get(key, pieces[key])
            return None if v is None else v.to(device=device, dtype=torch.long)

        slots = placed("slots")
        if isinstance(state_slots, (list, tuple)):  # the ops' slot range checks read these, no device value
            remember_host_values(slots, state_slots)
        batch = cls(
            cu_seqlens=remember_host_values(placed("cu"), cu), context_lens=placed("ctx"), positions=placed("pos"),
            block_tables=placed("tables"), state_slots=slots, checkpoints=checkpoints,
            seq_lens=list(seq_lens), context_lens_list=list(context_lens),
            num_accepted_tokens=placed("accepted"), rollback=rollback,
        )
        if host_tables is not None:
            batch._memo["host_tables"] = host_tables  # page checks on the host, no device sync
        return batch

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def cu_seqlens_list(self) -> list[int]:
        """cu_seqlens as a python list (from seq_lens: no device sync)."""
        if "cu" not in self._memo:
            cu = [0]
            for s in self.seq_lens:
                cu.append(cu[-1] + s)
            self._memo["cu"] = cu
        return self._memo["cu"]

    @property
    def is_verify(self) -> bool:
        return self.num_accepted_tokens is not None

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token (the pool-indexed recurrent path applies)."""
        return bool(self.seq_lens) and all(s == 1 for s in self.seq_lens)

    @property
    def uniform_width(self) -> int | None:
        """W when this is a decode or verify batch in which every sequence brings exactly W new
        tokens (decode: W = 1; the CUDA-graph runner pads verify rows to 1 + k), else None.
        Attention layers then attend for all sequences at once over a [N, W] query grid."""
        if "width" not in self._memo:  # asked by every attention and linear layer of a step
            w = self.seq_lens[0] if self.seq_lens and (self.is_decode or self.is_verify) else None
            self._memo["width"] = w if w is not None and all(s == w for s in self.seq_lens) else None
        return self._memo["width"]

    def shared(self, key, build, per_token: bool = False):
        """build(batch) once per step: what every layer of the step would compute alike from
        the batch (RoPE tables, attention masks), keyed by `key` (what it depends on besides the
        batch). A fresh batch per step (the CUDA-graph runners build one inside each capture)
        never carries a value over. per_token: the value is a tensor, or a tuple of tensors,
        with one row per new token ([T_total, ...]); a `column` then takes its rows of its
        grid's value, computed once for all the columns."""
        if key not in self._memo:
            if per_token and self._grid is not None:
                grid, j = self._grid
                value = grid.shared(key, build, per_token=True)
                self._memo[key] = tuple(grid.column_rows(t, j) for t in value) if isinstance(value, tuple) \
                    else grid.column_rows(value, j)
            else:
                self._memo[key] = build(self)
        return self._memo[key]

    def column(self, j: int) -> ForwardBatch:
        """For a batch of W new tokens per sequence (uniform_width; the grid): its token j of
        every sequence, at position context + j, as a batch of one new token per sequence. A
        chain of one-row steps (the MTP head's draft steps) runs as the columns 0 .. W - 1 of one
        grid: their KV rows, attention masks and per-token shared values (RoPE tables) are the
        grid's, computed once for all the columns. Column j attends to the grid's positions
        before it, which the earlier columns wrote. Only for layers without recurrent state
        (attention): its state_slots are the grid's column j, read as a decode step's."""
        w, n = self.uniform_width, self.num_seqs
        if w is None or not 0 <= j < w:
            raise ValueError(f"column {j} of a batch needs a uniform width above it, got {w}")
        pos = self.column_rows(self.positions, j)
        slots = self.state_slots[:, j] if self.state_slots.ndim == 2 else self.state_slots
        return ForwardBatch(cu_seqlens=constants.arange(n + 1, pos.device), context_lens=pos, positions=pos,
                            block_tables=self.block_tables, state_slots=slots, seq_lens=[1] * n,
                            context_lens_list=[c + j for c in self.context_lens_list], cuda_graph=self.cuda_graph,
                            _grid=(self, j))

    def column_rows(self, t: torch.Tensor, j: int) -> torch.Tensor:
        """t [T_total, ...] (a row per new token) -> its rows of column j [N, ...] (a view)."""
        return t.view(self.num_seqs, self.uniform_width, *t.shape[1:])[:, j]

    def token_seq_ids(self) -> torch.Tensor:
        """[T_total] index of the sequence each new token belongs to."""
        if "seq_ids" not in self._memo:
            device = self.positions.device
            w = self.seq_lens[0] if self.seq_lens else 1
            if w > 0 and all(s == w for s in self.seq_lens):  # no counts copied from the host (graph-safe)
                seqs = constants.constant(("seq_ids", self.num_tokens, w), device,
                                          lambda d: torch.arange(self.num_tokens, device=d) // w)
            else:  # the counts in a pinned transfer and the output size given: no wait for the stream
                seqs = torch.repeat_interleave(torch.arange(self.num_seqs, device=device),
                                               stage_long([self.seq_lens], device)[0], output_size=self.num_tokens)
            self._memo["seq_ids"] = seqs
        return self._memo["seq_ids"]

    def single_token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences that bring one new token (a mixed step's decode rows): (their rows of the
        packed tokens [S], their sequence indices [S]) on the batch's device, made once a step in
        one pinned transfer (a torch.tensor from a list waits for the stream)."""
        if "single_rows" not in self._memo:
            single = self.single_token_seqs()
            self._memo["single_rows"] = tuple(stage_long([[self.cu_seqlens_list[n] for n in single], single],
                                                         self.positions.device))
        return self._memo["single_rows"]

    def single_token_seqs(self) -> list[int]:
        """The indices of the sequences that bring one new token, on the host."""
        if "single_seqs" not in self._memo:
            self._memo["single_seqs"] = [n for n, s in enumerate(self.seq_lens) if s == 1]
        return self._memo["single_seqs"]

    def kv_slot_mapping(self, page_size: int) -> torch.Tensor:
        """[T_total] flat row (page * page_size + offset) of every new token in a paged KV pool."""
        key = ("slots", page_size)
        if key not in self._memo and self._grid is not None:
            grid, j = self._grid
            self._memo[key] = grid.column_rows(grid.kv_slot_mapping(page_size), j)
        if key not in self._memo:
            self.check_written_pages(page_size)
            rows, pos = self.page_rows(page_size), self.positions
            w = self.uniform_width
            self._memo[key] = (rows.gather(1, pos.view(self.num_seqs, w)).view(-1) if w is not None
                               else rows[self.token_seq_ids(), pos])
        return self._memo[key]

    def page_rows(self, page_size: int) -> torch.Tensor:
        """[N, max_pages * page_size] the flat pool row (page * page_size + offset) of every
        position covered by each block table, once per step: what the new tokens' KV rows
        (kv_slot_mapping) and the attention windows (query_window) index. Page -1 gives rows
        -page_size .. -1, which index the pool's last page (the CUDA-graph runners' scratch
        page), as page -1 does."""
        return self.shared(("page_rows", page_size), lambda b: _page_rows(b.block_tables, page_size))

    def check_written_pages(self, page_size: int) -> None:
        """Raise ValueError unless every position written in this step has a page: once per step,
        on the host copy of the tables when the batch was built from lists (no device sync), on
        the device otherwise; never in a CUDA-graph batch (a check would sync)."""
        key = ("checked", page_size)
        if key in self._memo or not self.num_tokens or self.cuda_graph:
            return
        host = self._memo.get("host_tables")
        if host is not None:
            self._check_written_pages(host, page_size)
        else:
            col = self.positions // page_size
            if int(col.max()) >= self.block_tables.shape[1]:
                raise ValueError("block_tables has too few page columns for the positions of this step")
            if bool((self.block_tables[self.token_seq_ids(), col] < 0).any()):
                raise ValueError("block_tables has no page (-1) for a position written in this step")
        self._memo[key] = True

    def _check_written_pages(self, host: list[list[int]], page_size: int) -> None:
        """check_written_pages on the host copy of the tables."""
        for table, new, ctx in zip(host, self.seq_lens, self.context_lens_list):
            if new == 0:
                continue
            last = (ctx + new - 1) // page_size
            if last >= len(table):
                raise ValueError("block_tables has too few page columns for the positions of this step")
            if any(p < 0 for p in table[ctx // page_size:last + 1]):
                raise ValueError("block_tables has no page (-1) for a position written in this step")

    def host_block_tables(self) -> list[list[int]]:
        """The block tables as python lists: the host copy of a batch built from lists, else read
        from the device once a step (a sync)."""
        if "host_tables" not in self._memo:
            self._memo["host_tables"] = self.block_tables.tolist()
        return self._memo["host_tables"]

    def context_pages(self, n: int, length: int, page_size: int) -> torch.Tensor:
        """[ceil(length / page_size)] the page ids of positions 0..length-1 of sequence n, checked
        to exist (on the host copy of the tables when the batch has one: no device sync)."""
        n_pages = -(-length // page_size)
        pages = self.block_tables[n, :n_pages]
        host = self._memo.get("host_tables")
        missing = (len(host[n]) < n_pages or any(p < 0 for p in host[n][:n_pages])) if host is not None \
            else (pages.shape[0] < n_pages or bool((pages < 0).any()))
        if missing:
            raise ValueError(f"block table of sequence {n} lacks a page for a position below {length}")
        return pages

    def decode_window(self, seqs: list[int], page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages and masks for one-query-token attention of sequences `seqs` (those of a mixed
        batch that bring one new token), as query_window's. Covers the first ceil(longest length
        / page_size) pages of each block table. Returns the window's flat pool rows
        [S, P * page_size] (padding pages masked out), masked [S, 1, P * page_size] (token t of
        the window is past the sequence) and unread [S, P * page_size] (the same, per sequence)."""
        device = self.block_tables.device
        host_lens = [self.context_lens_list[n] + 1 for n in seqs]
        index, lens = stage_long([seqs, host_lens], device)  # one pinned transfer: no wait for the stream
        tables = self.block_tables[index]
        n_pages = -(-max(host_lens) // page_size)
        pages = tables[:, :n_pages]
        unread = constants.arange(n_pages * page_size, device)[None, :] >= lens[:, None]
        return _page_rows(pages, page_size), unread[:, None, :], unread

    def query_window(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For a batch with `uniform_width` W: pages and causal masks of every sequence's W new
        tokens, once per step (every attention layer of the step reads them). Covers the first
        ceil((longest context + W) / page_size) pages of each block table, or every column for a
        CUDA-graph batch (whose shapes must not depend on the lengths). Returns the window's
        flat pool rows [N, P * page_size] (page_rows; padding pages masked out), masked
        [N, W, P * page_size] (new token i of
        sequence n, at position context + i, may not attend to token t: t > context + i) and
        unread [N, P * page_size] (no new token of sequence n attends to t; its last one sees the
        most: t > context + W - 1)."""
        w = self.uniform_width
        if w is None:
            raise ValueError("query_window needs a decode / verify batch with equal new-token counts")
        if self._grid is not None:  # a column: its rows of the grid's masks
            grid, j = self._grid
            pages, masked, _ = grid.query_window(page_size)
            return self.shared(("query_window", page_size), lambda b: (pages, masked[:, j:j + 1], masked[:, j]))
        return self.shared(("query_window", page_size), lambda b: b._query_window(w, page_size))

    def _query_window(self, w: int, page_size: int):
        device = self.block_tables.device
        if self.cuda_graph:
            n_pages = self.block_tables.shape[1]
        else:
            n_pages = -(-(max(self.context_lens_list) + w) // page_size)
        rows = self.page_rows(page_size)[:, :n_pages * page_size]
        last = self.context_lens[:, None] + constants.arange(w, device)  # [N, W] each query's position
        t = constants.arange(n_pages * page_size, device)
        masked = t[None, None, :] > last[:, :, None]
        return rows, masked, masked[:, -1]

    def has_context(self) -> torch.Tensor:
        """[N] bool: sequence n resumes from cached state (context_lens[n] > 0)."""
        return self.context_lens > 0


def _page_rows(tables: torch.Tensor, page_size: int) -> torch.Tensor:
    """tables [N, P] page ids -> [N, P * page_size] flat pool rows page * page_size + offset."""
    return (tables[:, :, None] * page_size + constants.arange(page_size, tables.device)).flatten(1)
