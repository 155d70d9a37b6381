"""The tensors of the prefix cache's storage tiers beside the running pools, and the transfers
between them. The PrefixCache decides what moves where (it owns the indices); this module only
holds memory and copies.

Tiers of a checkpoint (every linear layer's state + conv windows after some prefix):
- "slot": a state slot of the running pools (HybridCache), in the running dtype;
- "int8": an entry of the device's compact store (checkpoint_dtype "int8"): each state row in int8
  with an fp32 scale (hyla.engine.checkpoint_codec), conv windows as they are;
- "host": an entry of the host store (host_cache_bytes > 0), in pinned CPU memory on CUDA: a
  slot's bytes, or with checkpoint_dtype "int8" an int8 entry's (a slot is packed on its way).
Tiers of a KV page: a device page of the running pools, or a host page (the bytes of every
attention layer's page).

A transfer is a tuple (picklable: the tensor-parallel runner sends the same plan to every rank,
each of which moves its own shard):
    ("copy_slot", src_slot, dst_slot)        device checkpoint restore (slot home)
    ("copy_rows", src_page, dst_page, rows)  copy-on-write of a partially shared page
    ("pack", slot, entry)                    slot -> int8 entry (a checkpoint filed)
    ("unpack", entry, slot)                  int8 entry -> slot (restore)
    ("ckpt_out", tier, src, host)            slot or int8 entry (tier "slot" / "int8") -> host entry
    ("ckpt_in", host, slot)                  host entry -> slot (restore; dequantised with int8)
    ("page_out", page, host_page)            device page -> host page (eviction to the host)
    ("page_in", host_page, page)             host page -> device page (restore)
Plans run in order: a transfer that reads an index always precedes whatever reuses it later in
the plan or in the step's forward, so an index may be freed as soon as its copy is planned.
Consecutive page transfers of one direction move as one batch: per attention tensor, a gather of
the pages into a staging buffer on one side and a scatter out of it on the other, with one copy
per run of consecutive host pages. A page is a few KB per layer, and one copy per page and layer
(over a million copies in an agent run) made the copies' launches the bottleneck: the H100 host
tier round measured 3.6 GB/s of restores and a third of the run outside the model.

Every transfer is planned on the current (compute) stream, in plan order, before the step's
forward. Copies to the host go through hyla.engine.host_offload: on CUDA a source is copied into a
device buffer there and the buffer to pinned memory on a side stream, overlapped with the forward
(a restore that reads a host entry first waits for those copies). Copies from the host run on the
compute stream, asynchronous from pinned memory, so the host thread never waits for them. A
restored request runs in the step that planned its restore: its copy (tens of MB of state and
pages, a few ms over PCIe) costs that step less than a whole step of waiting (a step of chunked
prefill takes tens to hundreds of ms). Measured against restores on a side stream with the request
one step later: returning turns' TTFT 502 vs 607 ms, output 494 vs 424 tok/s (BENCHMARKS.md
"Prefix cache tiers").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyla.contract.cache import HybridCache
from hyla.engine.checkpoint_codec import dequantize_rows, quantize_rows, rows_of
from hyla.engine.device_timer import DeviceTimer
from hyla.engine.host_offload import STAGING_BYTES, DeviceToHost
from hyla.ops.transfer import to_device_long

CHECKPOINT_DTYPES = ("auto", "int8")  # EngineConfig.checkpoint_dtype / --checkpoint-dtype


@dataclass(frozen=True)
class TierSizes:
    """Entries of each tier beside the running pools: int8 entries on the device (0: checkpoints
    live in state slots), host pages and host checkpoints (0 and 0: no host tier)."""

    int8_entries: int = 0
    host_pages: int = 0
    host_checkpoints: int = 0


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """A contiguous view of a pool row (a K-last state slot is [.., K, V] over [.., V, K] memory)."""
    if t.is_contiguous():
        return t
    view = t.transpose(-1, -2)
    if view.is_contiguous():
        return view
    raise ValueError(f"a pool row of shape {tuple(t.shape)} and strides {t.stride()} is not contiguous")


def int8_entry_bytes(cache: HybridCache) -> int:
    """Bytes of one int8 checkpoint of `cache`'s linear layers (int8 state + fp32 row scales +
    conv windows as stored)."""
    total = 0
    for layer in cache.linear_layers:
        state, *conv = layer.tensors()
        elems = state[0].numel()
        total += elems + 4 * elems // state.shape[-2]  # one fp32 scale per row of K entries
        total += sum(c[0].numel() * c.element_size() for c in conv)
    return total


class _Int8Store:
    """Per linear layer: q [E, HV, V, K] int8, scale [E, HV, V] fp32, conv copies [E, ...]."""

    def __init__(self, cache: HybridCache, entries: int, device, pin: bool = False):
        self.layers = []
        for layer in cache.linear_layers:
            state, *conv = layer.tensors()
            rows = rows_of(state[0])
            q = torch.empty((entries, *rows.shape), dtype=torch.int8, device=device, pin_memory=pin)
            scale = torch.empty((entries, *rows.shape[:-1]), dtype=torch.float32, device=device, pin_memory=pin)
            convs = [torch.empty((entries, *_memory_order(c[0]).shape), dtype=c.dtype, device=device, pin_memory=pin)
                     for c in conv]
            self.layers.append((q, scale, convs))

    def tensors(self) -> list[torch.Tensor]:
        return [t for q, s, convs in self.layers for t in (q, s, *convs)]


class _FullStore:
    """Per linear layer, every slot tensor's bytes [E, ...] (in memory order)."""

    def __init__(self, cache: HybridCache, entries: int, device, pin: bool = False):
        self.tensors_ = [torch.empty((entries, *_memory_order(t[0]).shape), dtype=t.dtype, device=device,
                                     pin_memory=pin)
                         for layer in cache.linear_layers for t in layer.tensors()]

    def tensors(self) -> list[torch.Tensor]:
        return self.tensors_


class CacheTiers:
    """The int8 store and the host store of one runner's cache (one rank's shard), and the code
    that runs a transfer plan against them and the running pools."""

    def __init__(self, cache: HybridCache, sizes: TierSizes, staging_bytes: int | None = None):
        self.cache = cache
        self.sizes = sizes
        self.device = device = self._device()
        pin = device.type == "cuda"
        self.int8 = _Int8Store(cache, sizes.int8_entries, device) if sizes.int8_entries else None
        self.host_checkpoints = None
        if sizes.host_checkpoints:
            kind = _Int8Store if self.int8 is not None else _FullStore
            self.host_checkpoints = kind(cache, sizes.host_checkpoints, "cpu", pin)
        self.page_tensors = [t for layer in cache.attention_layers for t in layer.tensors()]
        self.host_pages = [torch.empty((sizes.host_pages, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)
                           for t in self.page_tensors] if sizes.host_pages else None
        self._stats = {"bytes_to_host": 0, "bytes_from_host": 0}
        self.restore_time = DeviceTimer(device)  # the host -> device copies' device time
        staging = STAGING_BYTES if staging_bytes is None else staging_bytes  # read here: tests set it
        self.to_host = DeviceToHost(device, staging if sizes.host_pages or sizes.host_checkpoints else 0)

    @property
    def stats(self) -> dict:
        """bytes_to_host, bytes_from_host and restore_seconds: the time the restores (host ->
        device copies, dequantisation included) took where they ran (hyla.engine.device_timer:
        CUDA events around each restore on its stream, counted once complete; wall time on the
        CPU)."""
        return {**self._stats, "restore_seconds": self.restore_time.seconds}

    def _device(self) -> torch.device:
        for layer in self.cache.layers:
            for t in layer.tensors():
                return t.device
        return torch.device("cpu")

    def nbytes(self) -> tuple[int, int]:
        """(device bytes, host bytes) the tiers hold."""
        dev = sum(t.numel() * t.element_size() for t in (self.int8.tensors() if self.int8 else []))
        host = sum(t.numel() * t.element_size() for t in (self.host_checkpoints.tensors()
                                                          if self.host_checkpoints else []))
        host += sum(t.numel() * t.element_size() for t in (self.host_pages or []))
        return dev, host

    # ---- the transfers -------------------------------------------------------------------
    def apply(self, plan: list[tuple]) -> None:
        """Run a transfer plan in order on the current stream, its copies to the host started on
        their side stream at the end (see the module docstring)."""
        for op, *args in _page_batches(plan):
            getattr(self, "_" + op)(*args)
        self.to_host.flush()

    def _copy_slot(self, src: int, dst: int) -> None:
        self.cache.copy_slot(src, dst)

    def _copy_rows(self, src: int, dst: int, rows: int) -> None:
        self.cache.copy_page_rows(src, dst, rows)

    def _pack(self, slot: int, entry: int) -> None:
        _pack_into(self.cache, slot, self.int8, entry, _device_copy)

    def _unpack(self, entry: int, slot: int) -> None:
        _unpack_from(self.int8, entry, self.cache, slot)

    def _ckpt_out(self, tier: str, src: int, host: int) -> None:
        if tier == "int8":  # the int8 entry's bytes
            for h, d in zip(self.host_checkpoints.tensors(), self.int8.tensors()):
                self.to_host.copy(h[host], d[src])
                self._stats["bytes_to_host"] += d[src].numel() * d.element_size()
            return
        if self.int8 is not None:  # a slot, packed on its way to the int8 host store
            _pack_into(self.cache, src, self.host_checkpoints, host, self.to_host.copy)
            self._stats["bytes_to_host"] += sum(t[host].numel() * t.element_size()
                                               for t in self.host_checkpoints.tensors())
            return
        slot_tensors = [t for layer in self.cache.linear_layers for t in layer.tensors()]
        for h, t in zip(self.host_checkpoints.tensors(), slot_tensors):
            self.to_host.copy(h[host], _memory_order(t[src]))
            self._stats["bytes_to_host"] += t[src].numel() * t.element_size()

    def _ckpt_in(self, host: int, slot: int) -> None:
        self.to_host.fence()  # the entry may have been written on the side stream
        with self.restore_time.measure():
            if self.int8 is not None:
                device = self.device
                for (q, scale, convs), layer in zip(self.host_checkpoints.layers, self.cache.linear_layers):
                    state, *conv = layer.tensors()
                    dequantize_rows(q[host].to(device, non_blocking=True), scale[host].to(device, non_blocking=True),
                                    rows_of(state[slot]))
                    for c_host, c in zip(convs, conv):
                        _memory_order(c[slot]).copy_(c_host[host], non_blocking=True)
                    self._stats["bytes_from_host"] += sum(t[host].numel() * t.element_size()
                                                          for t in (q, scale, *convs))
            else:
                slot_tensors = [t for layer in self.cache.linear_layers for t in layer.tensors()]
                for h, t in zip(self.host_checkpoints.tensors(), slot_tensors):
                    _memory_order(t[slot]).copy_(h[host], non_blocking=True)
                    self._stats["bytes_from_host"] += h[host].numel() * h.element_size()

    def _page_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device page, host page) pairs: each device page's bytes of every attention layer into
        its host page, as a batch (module docstring)."""
        pages, hosts = _by_destination(pairs, host=1)
        idx = to_device_long(pages, self.device)  # through pinned memory, no stall
        for h, t in zip(self.host_pages, self.page_tensors):
            h, t = _indexable(h), _indexable(t)
            staged = t.index_select(0, idx)  # [n, ...] the pages in host order: the buffer itself
            for a, b in _runs(hosts):
                self.to_host.copy(h[hosts[a]:hosts[a] + b - a], staged[a:b], owned=True)
            self._stats["bytes_to_host"] += staged.numel() * staged.element_size()

    def _page_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host page, device page) pairs, as a batch. The whole page, also the rows past a partial
        hit: the request writes those positions before anything reads them (attention is causal),
        as it would in a fresh page."""
        hosts, pages = _by_destination(pairs, host=0)
        self.to_host.fence()  # the entries may have been written on the side stream
        with self.restore_time.measure():
            idx = to_device_long(pages, self.device)  # through pinned memory, no stall
            for h, t in zip(self.host_pages, self.page_tensors):
                h, t = _indexable(h), _indexable(t)
                staged = torch.empty((len(hosts), *t.shape[1:]), dtype=t.dtype, device=t.device)
                for a, b in _runs(hosts):
                    staged[a:b].copy_(h[hosts[a]:hosts[a] + b - a], non_blocking=True)
                t.index_copy_(0, idx, staged)
                self._stats["bytes_from_host"] += staged.numel() * staged.element_size()


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """t, or its bytes for the one-byte float formats (fp8 KV pages), which index_select and
    index_copy_ do not take."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _page_batches(plan: list[tuple]) -> list[tuple]:
    """The plan with each run of consecutive page_out (or page_in) transfers as one transfer
    ("page_out", [(page, host), ...]) (or ("page_in", [(host, page), ...])); the rest as it is."""
    out = []
    for op, *args in plan:
        if op in ("page_out", "page_in"):
            if out and out[-1][0] == op:  # only page transfers are batched, so this one's batch
                out[-1][1].append(tuple(args))
            else:
                out.append((op, [tuple(args)]))
        else:
            out.append((op, *args))
    return out


def _by_destination(pairs: list[tuple[int, int]], host: int) -> tuple[list[int], list[int]]:
    """(source, destination) pairs -> (sources, destinations) with one pair per destination (the
    last one planned wins: an earlier write to it was dead), sorted by the host side (pair[host]),
    so that runs of consecutive host pages move in one copy."""
    last = {p[1]: p for p in pairs}
    ordered = sorted(last.values(), key=lambda p: p[host])
    return [p[0] for p in ordered], [p[1] for p in ordered]


def _runs(sorted_indices: list[int]) -> list[tuple[int, int]]:
    """Positions [a, b) of the maximal runs of consecutive values in a sorted list."""
    runs, a = [], 0
    for i in range(1, len(sorted_indices) + 1):
        if i == len(sorted_indices) or sorted_indices[i] != sorted_indices[i - 1] + 1:
            runs.append((a, i))
            a = i
    return runs


def _device_copy(dst: torch.Tensor, src: torch.Tensor, owned: bool = False) -> None:
    dst.copy_(src)


def _pack_into(cache: HybridCache, slot: int, store: _Int8Store, entry: int, copy) -> None:
    """Slot `slot` of `cache` quantised into `store`'s entry through copy(dst, src, owned) (the
    device store's plain copy, or DeviceToHost.copy into the host's)."""
    for (q, scale, convs), layer in zip(store.layers, cache.linear_layers):
        state, *conv = layer.tensors()
        q_rows, s_rows = quantize_rows(rows_of(state[slot]))
        copy(q[entry], q_rows, owned=True)
        copy(scale[entry], s_rows, owned=True)
        for c_store, c in zip(convs, conv):
            copy(c_store[entry], _memory_order(c[slot]))


def _unpack_from(store: _Int8Store, entry: int, cache: HybridCache, slot: int) -> None:
    for (q, scale, convs), layer in zip(store.layers, cache.linear_layers):
        state, *conv = layer.tensors()
        dequantize_rows(q[entry], scale[entry], rows_of(state[slot]))
        for c_store, c in zip(convs, conv):
            _memory_order(c[slot]).copy_(c_store[entry])


def plain_transfers(cache: HybridCache, plan: list[tuple]) -> None:
    """Run a plan that uses no tier (device copies only): the engine without int8 or host tiers."""
    for op, *args in plan:
        if op == "copy_slot":
            cache.copy_slot(*args)
        elif op == "copy_rows":
            cache.copy_page_rows(*args)
        else:
            raise ValueError(f"transfer {op!r} needs the prefix cache's tiers, which this runner does not have")
