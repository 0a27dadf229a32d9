"""kvlab.PagedPool: the paged pool as a Python object you can look at.

The pool itself is C: its block manager (block tables, ref counts, copy-on-write, prefix
cache: csrc/blocks.c) and the K/V stores behind the blocks (csrc/paged.c). This module adds
what a notebook needs on top, for any pool whichever device holds its rows (the GPU pool,
kvlab.cuda.CudaPagedPool, is this class with its rows in GPU memory): statistics with the
internal-fragmentation figure, and text and HTML pictures of which block holds what.

    pool = model.new_paged_pool(num_blocks=64, block_size=16)
    seq = pool.new_sequence()
    model.prefill(tokens, seq)          # K and V land in blocks seq.block_table
    child = pool.fork(seq)              # shares every block; copy-on-write later
    host = pool.swap_out(child)         # its K and V to host memory, its blocks freed
    child = pool.swap_in(host)          # back in fresh blocks, bit for bit
    pool                                # in a notebook: the block map
"""
from __future__ import annotations

import dataclasses
import html

import numpy as np
from . import arguments
from ._core import core
from ._text import plural

PagedSequence = core.PagedSequence


def check_token_elements(tokens) -> np.ndarray:
    """tokens as a NumPy array of integers, refusing (ArgumentTypeError, a TypeError and a
    ValueError) what is not an integer id: an array of floats or bools, and in a list a
    bool (np.asarray([True, 5]) would quietly be [1, 5]), a float or a string. Ids too
    large for any integer type are a ValueError (out of range), not a TypeError."""
    if isinstance(tokens, (str, bytes)):
        raise arguments.ArgumentTypeError(f"token ids must be integers, got a {type(tokens).__name__}")
    if not isinstance(tokens, np.ndarray):
        items = tokens if isinstance(tokens, (list, tuple)) else None
        if items is None:
            try:
                items = list(tokens)
            except TypeError:
                raise arguments.ArgumentTypeError(
                    f"token ids must be a sequence of integers, got {type(tokens).__name__}") from None
            tokens = items
        for i, token in enumerate(items):
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                if isinstance(token, (list, tuple, np.ndarray)):
                    break                            # nested: the shape check names it
                raise arguments.ArgumentTypeError(
                    f"token ids must be integers, got {_short(token)} "
                    f"({type(token).__name__}) at index {i}")
            if not -2**63 <= token < 2**63:
                raise ValueError(f"token id {token} is out of range")
    array = np.asarray(tokens)
    if array.dtype == bool or array.dtype.kind not in "iu":
        if array.size == 0:
            return np.zeros(0, dtype=np.int32)       # no ids (the callers say if that is wrong)
        raise arguments.ArgumentTypeError(f"token ids must be integers, got an array of {array.dtype}")
    return array


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
# [quote ch04-poolstats]
class PoolStats:
    blocks_used: int        # referenced by at least one block table
    blocks_free: int        # on the free list
    blocks_cached: int      # unreferenced full blocks kept for prefix reuse
    tokens_stored: int      # rows written in used blocks (shared rows counted once)
    slots_unused: int       # rows of used blocks not written yet: internal fragmentation
    n_sequences: int
    prefix_hits: int        # full blocks found in the prefix cache
    prefix_misses: int      # full blocks looked up and not found

    @property
    def slots_allocated(self) -> int:
        return self.tokens_stored + self.slots_unused

    @property
    def fragmentation_percent(self) -> float:
        """Share of allocated slots that hold nothing."""
        return 100.0 * self.slots_unused / self.slots_allocated if self.slots_allocated else 0.0
# [end ch04-poolstats]


@dataclasses.dataclass(frozen=True, eq=False)
class SwappedSequence:
    """A paged sequence swapped out to host memory (PagedPool.swap_out): its tokens, its
    K and V rows exactly as the pool stored them (codes, scales and zero points of a
    quantized format, not dequantized floats), and what it needs to go on where it
    stopped. PagedPool.swap_in puts it back into fresh blocks of a pool of the same shape
    and formats. `data` is one read-only byte buffer laid out by the core (csrc/swap.c)."""
    data: np.ndarray        # uint8 (nbytes,), read-only
    length: int             # positions it holds
    n_blocks: int           # blocks it takes to come back (same block size): the blocks it
                            # held, less one if rows keep() dropped from its front left room

    @property
    def nbytes(self) -> int:
        """Host memory it takes: what a swap moves each way."""
        return self.data.nbytes

    def __repr__(self) -> str:
        return (f"SwappedSequence(length={self.length}, n_blocks={self.n_blocks}, "
                f"nbytes={self.nbytes:,})")


class PoolViews:
    """What every paged pool shows, over its block manager (core.BlockManager): the
    PagedPool below, on the CPU or, as kvlab.cuda.CudaPagedPool, on the GPU.
    isinstance(pool, PoolViews) is how kvlab recognises a paged pool on any device."""

    def reuse_prefix(self, seq, tokens, max_tokens=None) -> int:
        """Attach the cached full blocks holding the longest prefix of tokens[:max_tokens]
        to an empty sequence; returns how many tokens they cover. tokens: any sequence of
        integer ids (a list, or an int array of any width; not bools, floats or strings).
        max_tokens: None, or an integer >= 0."""
        array = check_token_elements(tokens)
        if array.size and array.dtype != np.int32:
            if array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max:
                raise ValueError("token ids must fit in 32 bits")
            array = array.astype(np.int32)
        if max_tokens is not None:
            max_tokens = arguments.count(max_tokens, "max_tokens", arguments.INT64_MAX)
        return super().reuse_prefix(seq, np.require(array, np.int32, ["C_CONTIGUOUS", "ALIGNED"]),
                                    max_tokens)

    # The core's methods that take a count, checked here as every kvlab size is (a bool,
    # 2.0 or 2**63 named, not read as 1 or refused in C's words).
    def truncate(self, seq, length):
        """Forget seq's positions from `length` (an integer >= 0) on."""
        return super().truncate(seq, arguments.count(length, "length", arguments.INT64_MAX))

    def reserve(self, seq, n_tokens):
        """Blocks for n_tokens (an integer >= 0) more positions of seq: see the core's doc."""
        return super().reserve(seq, arguments.count(n_tokens, "n_tokens", arguments.INT64_MAX))

    def blocks_needed(self, seq, n_tokens) -> int:
        """Blocks that appending n_tokens (an integer >= 0) to seq would take."""
        return super().blocks_needed(seq, arguments.count(n_tokens, "n_tokens",
                                                          arguments.INT64_MAX))

    def stats(self) -> PoolStats:
        return PoolStats(**super().stats())

    def block_state(self, block: int) -> str:
        """'used', 'cached' or 'free'."""
        if self.ref_counts[block] > 0:
            return "used"
        return "cached" if block in set(self.cached_blocks) else "free"

    # ---- pictures ----------------------------------------------------------------------
    def render(self, width: int = 64) -> str:
        """A text map: one character per block ('.' free, 'c' cached, the ref count if
        used, '+' above 9), then each sequence's block table (and its start, once keep()
        dropped rows from its front)."""
        refs, cached = self.ref_counts, set(self.cached_blocks)
        cells = []
        for b in range(self.num_blocks):
            if refs[b] > 0:
                cells.append(str(refs[b]) if refs[b] < 10 else "+")
            else:
                cells.append("c" if b in cached else ".")
        s = self.stats()
        lines = [f"PagedPool: {plural(self.num_blocks, 'block')} x "
                 f"{plural(self.block_size, 'token')}, "
                 f"{s.blocks_used} used, {s.blocks_cached} cached, {s.blocks_free} free; "
                 f"{plural(s.tokens_stored, 'token')} stored, "
                 f"{plural(s.slots_unused, 'slot')} unused "
                 f"({s.fragmentation_percent:.1f} %); prefix hits {s.prefix_hits}, "
                 f"misses {s.prefix_misses}"]
        for start in range(0, self.num_blocks, width):
            lines.append(f"  {start:5d} {''.join(cells[start:start + width])}")
        for seq in self.sequences():
            table = ", ".join(str(b) for b in seq.block_table)
            # a window's rows begin past the ones it dropped from its first block
            start = f" from row {seq.start} of its first block" if seq.start else ""
            lines.append(f"  seq {seq.id}: length {seq.length}{start}, blocks [{table}]")
        return "\n".join(lines)

    def __repr__(self) -> str:
        s = self.stats()
        return (f"PagedPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"used={s.blocks_used}, cached={s.blocks_cached}, free={s.blocks_free}, "
                f"sequences={s.n_sequences}, nbytes={self.nbytes:,})")

    def _repr_html_(self) -> str:
        refs, fill, cached = self.ref_counts, self.fill, set(self.cached_blocks)
        colors = {"used": "#4c78a8", "shared": "#f58518", "cached": "#9ecae9", "free": "#eeeeee"}
        cells = []
        for b in range(self.num_blocks):
            if refs[b] > 1:
                kind = "shared"
            elif refs[b] == 1:
                kind = "used"
            else:
                kind = "cached" if b in cached else "free"
            title = f"block {b}: {kind}, ref {refs[b]}, {fill[b]}/{self.block_size} rows"
            text_color = "white" if kind in ("used", "shared") else "#333"
            cells.append(f'<div title="{title}" style="width:34px;height:30px;margin:1px;'
                         f'background:{colors[kind]};color:{text_color};font:10px monospace;'
                         f'display:inline-block;text-align:center;line-height:14px">'
                         f'{b}<br>{"r" + str(refs[b]) if refs[b] else kind[0]}</div>')
        rows = []
        for seq in self.sequences():
            table = " ".join(f'<span style="background:{colors["shared" if refs[b] > 1 else "used"]};'
                             f'color:white;padding:0 3px;margin:1px">{b}</span>'
                             for b in seq.block_table)
            rows.append(f"<tr><td>seq {seq.id}</td><td>{seq.length}</td><td>{table}</td></tr>")
        s = self.stats()
        legend = " ".join(f'<span style="background:{c};padding:0 4px">{html.escape(k)}</span>'
                          for k, c in colors.items())
        return (f"<div><b>PagedPool</b>: {plural(self.num_blocks, 'block')} x "
                f"{plural(self.block_size, 'token')}; "
                f"{s.blocks_used} used, {s.blocks_cached} cached, {s.blocks_free} free; "
                f"{plural(s.tokens_stored, 'token')}, {plural(s.slots_unused, 'slot')} unused "
                f"({s.fragmentation_percent:.1f} %) {legend}"
                f"<div style='max-width:760px'>{''.join(cells)}</div>"
                f"<table><tr><th>sequence</th><th>length</th><th>block table</th></tr>"
                f"{''.join(rows)}</table></div>")


class PagedPool(PoolViews, core.PagedPool):
    """A pool of fixed-size KV blocks shared by many sequences, K and V in host memory
    (csrc/blocks.c keeps the books, csrc/paged.c the rows), or in GPU memory for
    kvlab.cuda.CudaPagedPool (the same books; a GPU store moves the rows)."""

    # Swapping copies with the core (csrc/swap.c), not with NumPy over key_codes and the
    # other views: the views are read-only and strided (a sequence's rows are one run per
    # layer, KV head and block), and a sequence swapped in must get its blocks, rows,
    # tokens and state in one call that either does everything or, refused, nothing.
    def swap_out(self, seq) -> SwappedSequence:
        """Preemption by swapping, first half: copy seq's K and V (every layer, exactly the
        bytes the pool stores), its tokens and its state to host memory, then free seq.
        Only seq's own references go: a block it shares with another sequence (a fork, a
        prefix found in the cache) keeps its rows for that one, and its full blocks stay in
        the prefix cache as a freed sequence's do. Returns the copy; seq is freed. Raises,
        changing nothing, for a sequence with a reservation pending or of another pool."""
        if not isinstance(seq, PagedSequence):
            raise TypeError(f"expected a PagedSequence, got {type(seq).__name__}")
        length = seq.length                   # (a freed one raises here)
        # it comes back from row 0 of a fresh block: its start (seq.start) takes no room
        n_blocks = -(-length // self.block_size)
        data = super().swap_out(seq)
        data.flags.writeable = False        # the rows must come back as they left
        return SwappedSequence(data, length, n_blocks)

    def swap_in(self, host: SwappedSequence) -> PagedSequence:
        """Preemption by swapping, second half: a new sequence, in fresh blocks, holding
        exactly what swap_out copied: its next forward calls give, bit for bit, the logits
        they would have given had it never left (no prefill again). host stays valid (it
        can be swapped in again); drop it to free its memory. Raises, changing nothing:
        OutOfBlocks (fewer free or cached blocks than its length takes in this pool's
        block size: host.n_blocks if the same), OutOfSequences,
        CacheFullError (more blocks than a sequence may hold), ValueError (a copy from a
        pool of another shape or cache format, or bytes whose header, size or row positions
        no swap_out writes). The K and V rows and tokens are taken as they are, as append()
        takes any rows: bytes changed there are not detected."""
        if not isinstance(host, SwappedSequence):
            raise TypeError(f"swap_in takes what swap_out returned (a SwappedSequence), "
                            f"got {type(host).__name__}")
        # Only the bytes are trusted: the core reads the length and everything else from
        # their header and checks it (host.length and host.n_blocks are for the caller's
        # bookkeeping, and a SwappedSequence can be made with any numbers).
        return super().swap_in(host.data)
