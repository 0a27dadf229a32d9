"""Serving beyond one engine, simulated on one machine with the kit's own pieces (chapter 11).

Four small simulations a student can read and run, each a page or less:

  tensor parallelism   K/V bytes per GPU when a model's heads are split over `tp` GPUs
                       (kv_bytes_per_gpu): each GPU holds n_kv_heads / tp KV heads, and once
                       tp passes n_kv_heads each GPU still holds one, so KV heads are copied.
  radix tree           SGLang's prefix sharing over token ids (RadixTree): any shared prefix,
                       to the token, against the kit's block hashing (block_hash_hits, the
                       paged pool's own prefix cache), which shares only full blocks.
  K/V tiers            the pool's swap_out bytes kept in host memory or written to a file and
                       read back (offload, restore), timed against computing the same K and V
                       again (measure_tiers); Tier says what a tier of given bandwidth costs.
  disaggregation       a prefill engine and a decode engine (two kvlab.Engine) joined by a link:
                       a request's K and V leave the prefill engine as pool.swap_out bytes and
                       reach the decode engine after nbytes / link bandwidth (Disaggregated).

It is not a distributed system: nothing here uses a network, a second process or a GPU. The
GPUs, links and disks are numbers (bandwidths, a step-time model); the K and V, the tokens
and the bytes moved are the kit's real ones, so the greedy tokens of a disaggregated run are
exactly one engine's.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import arguments
from .config import ModelConfig
from .engine import Engine
from .paged import SwappedSequence
from .scheduler import SamplingParams
from .serving import _run_virtual
from .slo import StepCost, VirtualClock, goodput_report


# ---- tensor parallelism: K/V bytes per GPU ------------------------------------------------

# [quote ch11-kv-heads-per-gpu]
def kv_heads_per_gpu(n_heads: int, n_kv_heads: int, tp: int) -> int:
    """KV heads each of `tp` GPUs holds when attention is split by heads (Megatron-style
    tensor parallelism): each GPU takes n_heads / tp query heads and the KV heads they read.
    With tp <= n_kv_heads the KV heads are split too (n_kv_heads / tp each); past that a
    GPU's query heads still read one KV head, which it must hold: the KV heads are copied,
    each to tp / n_kv_heads GPUs."""
    tp = arguments.positive(tp, "tp")
    if n_heads % tp:
        raise ValueError(f"tp={tp} does not divide the {n_heads} query heads")
    if tp <= n_kv_heads:
        if n_kv_heads % tp:
            raise ValueError(f"tp={tp} does not divide the {n_kv_heads} KV heads")
        return n_kv_heads // tp
    if tp % n_kv_heads:
        raise ValueError(f"tp={tp} is not a multiple of the {n_kv_heads} KV heads")
    return 1
# [end ch11-kv-heads-per-gpu]


def kv_bytes_per_gpu(config: ModelConfig, tp: int, element_bytes: int = 2) -> dict:
    """One token's K and V as `tp` GPUs hold it: per GPU, over all of them, and how many
    times the model's own K/V bytes that total is (1.0 until tp passes n_kv_heads).
    element_bytes: 2 for fp16/bf16, 1 for an 8-bit cache."""
    element_bytes = arguments.positive(element_bytes, "element_bytes")
    heads = kv_heads_per_gpu(config.n_heads, config.n_kv_heads, tp)
    per_gpu = 2 * config.n_layers * heads * config.head_dim * element_bytes   # K and V
    model = 2 * config.n_layers * config.n_kv_heads * config.head_dim * element_bytes
    return {"tp": int(tp), "kv_heads_per_gpu": heads, "per_gpu": per_gpu,
            "all_gpus": per_gpu * int(tp), "copies": per_gpu * int(tp) / model}


# The shapes of chapter 11's table, as numbers (no download): SmolLM2's is the kit's own
# model's; the Llama 3 ones are from Meta's model card and paper (references.md).
SHAPES = {
    "SmolLM2-135M": ModelConfig(dim=576, hidden_dim=1536, n_layers=30, n_heads=9, n_kv_heads=3,
                                vocab_size=49152, max_seq_len=8192, name="SmolLM2-135M"),
    "Llama-3-8B": ModelConfig(dim=4096, hidden_dim=14336, n_layers=32, n_heads=32,
                              n_kv_heads=8, vocab_size=128256, max_seq_len=8192,
                              tied_embeddings=False, name="Llama-3-8B"),
    "Llama-3-70B": ModelConfig(dim=8192, hidden_dim=28672, n_layers=80, n_heads=64,
                               n_kv_heads=8, vocab_size=128256, max_seq_len=8192,
                               tied_embeddings=False, name="Llama-3-70B"),
}


def tokens_per_gpu(config: ModelConfig, tp: int, gpu_bytes: float, element_bytes: int = 2) -> int:
    """Tokens of K/V one GPU holds beside its 1/tp of the weights (in element_bytes each):
    the room tensor parallelism buys, and what copied KV heads take back. 0 if the weights
    do not fit."""
    weights = config.n_params() * element_bytes / arguments.positive(tp, "tp")
    left = float(gpu_bytes) - weights
    per_token = kv_bytes_per_gpu(config, tp, element_bytes)["per_gpu"]
    return max(0, int(left // per_token))


# ---- radix-tree prefix sharing --------------------------------------------------------------

class _Node:
    __slots__ = ("edge", "children")

    def __init__(self, edge: tuple):
        self.edge = edge                         # the tokens on the edge into this node
        self.children: Dict[int, "_Node"] = {}   # by the first token of each child's edge


class RadixTree:
    """SGLang's radix tree over token ids, without K and V: every prompt inserted is a path
    from the root, edges hold runs of tokens, and a node splits where two prompts part.
    match(tokens) is the longest prefix of tokens that any inserted prompt shares: what a
    radix cache reuses, to the token. (SGLang keeps each node's K/V rows and evicts leaves
    by LRU; here the tree only counts, which is what the chapter compares.)"""

    def __init__(self):
        self.root = _Node(())
        self.n_tokens = 0        # tokens stored on all edges: what the cache would hold

    # [quote ch11-radix-match]
    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of tokens that the tree holds."""
        tokens, node, matched = _ids(tokens), self.root, 0
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            same = _common(child.edge, tokens, matched)
            matched += same
            if same < len(child.edge):           # parted inside the edge
                break
            node = child
        return matched
    # [end ch11-radix-match]

    def insert(self, tokens: Sequence[int]) -> int:
        """Add a prompt's path; returns how many of its tokens the tree held already."""
        tokens, node, i = _ids(tokens), self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:                    # a new leaf holds the rest
                node.children[tokens[i]] = _Node(tokens[i:])
                self.n_tokens += len(tokens) - i
                return i
            same = _common(child.edge, tokens, i)
            if same < len(child.edge):           # split the edge where the prompt parts
                middle = _Node(child.edge[:same])
                child.edge = child.edge[same:]
                middle.children[child.edge[0]] = child
                node.children[tokens[i]] = middle
                child = middle
            node, i = child, i + same
        return i


def _ids(tokens) -> tuple:
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"tokens must be a 1-D sequence of integer ids, got {_what(tokens)}")
    return tuple(int(t) for t in array)


def _what(value) -> str:
    array = np.asarray(value) if not isinstance(value, (str, bytes)) else None
    return (f"{type(value).__name__}" if array is None else
            f"{type(value).__name__} of shape {array.shape} and dtype {array.dtype}")


def _common(edge: tuple, tokens: tuple, start: int) -> int:
    """How many tokens edge and tokens[start:] share from their first."""
    n = min(len(edge), len(tokens) - start)
    for i in range(n):
        if edge[i] != tokens[start + i]:
            return i
    return n


def radix_hits(prompts: Sequence[Sequence[int]]) -> List[int]:
    """Per prompt, in order, the tokens a radix cache holding every earlier prompt reuses.
    The last token is always computed (its logits choose the next), as in the pool: a
    prompt's tokens[:-1] are matched."""
    tree, hits = RadixTree(), []
    for prompt in prompts:
        prompt = _ids(prompt)
        hits.append(tree.match(prompt[:-1]))
        tree.insert(prompt)
    return hits


def block_hash_hits(model, prompts: Sequence[Sequence[int]], block_size: int,
                    num_blocks: Optional[int] = None) -> List[int]:
    """Per prompt, in order, the tokens the kit's own prefix cache reuses (PagedPool's
    chained block hashes, chapter 4): each prompt runs through the model into a pool
    sequence, after pool.reuse_prefix attached the cached full blocks of its tokens[:-1],
    and is freed, leaving its full blocks cached for the prompts after it. num_blocks: the
    pool's size (default: room for every prompt, so nothing is evicted)."""
    prompts = [_ids(p) for p in prompts]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("block_hash_hits needs prompts of at least one token each")
    block_size = arguments.positive(block_size, "block_size")
    needed = sum(-(-len(p) // block_size) for p in prompts)
    pool = model.new_paged_pool(num_blocks or needed, block_size)
    hits = []
    for prompt in prompts:
        seq = pool.new_sequence()
        found = pool.reuse_prefix(seq, prompt[:-1])
        model.forward(np.asarray(prompt[found:], np.int64), cache=seq)
        pool.free(seq)
        hits.append(int(found))
    return hits


def block_loss(lcp: int, block_size: int) -> int:
    """Tokens a block cache cannot reuse of a shared prefix of lcp tokens: the part past
    its last full block."""
    return lcp % arguments.positive(block_size, "block_size")


# ---- K/V tiers ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Tier:
    """A place K and V can wait below the pool: moving n bytes there or back costs
    latency + n / bytes_per_s seconds. The numbers are a tier's, not measured here (the
    chapter's measured ones come from measure_tiers)."""
    name: str
    bytes_per_s: float          # what the link to it moves each second
    latency_s: float = 0.0      # what each transfer costs before its first byte

    def __post_init__(self):
        if not (isinstance(self.bytes_per_s, (int, float)) and math.isfinite(self.bytes_per_s)
                and self.bytes_per_s > 0):
            raise ValueError(f"{self.name}: bytes_per_s must be a positive number of bytes "
                             f"per second, got {self.bytes_per_s!r}")
        if not (isinstance(self.latency_s, (int, float)) and math.isfinite(self.latency_s)
                and self.latency_s >= 0):
            raise ValueError(f"{self.name}: latency_s must be >= 0 seconds, got {self.latency_s!r}")

    def seconds(self, nbytes: int) -> float:
        """What moving nbytes to this tier, or back, costs."""
        return self.latency_s + arguments.count(nbytes, "nbytes", arguments.INT64_MAX) / self.bytes_per_s


def offload(pool, seq, path: Optional[os.PathLike] = None) -> SwappedSequence:
    """Move seq's K and V out of the pool (pool.swap_out frees seq): into host memory, or,
    with path, also into that file (its bytes, flushed to the disk). Returns the host copy;
    restore() brings it back."""
    host = pool.swap_out(seq)
    if path is not None:
        with open(path, "wb") as file:
            file.write(host.data.tobytes())
            file.flush()
            os.fsync(file.fileno())          # the bytes reach the disk, not the page cache
            if hasattr(os, "posix_fadvise"):  # and the read back comes from the disk too:
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)   # (Linux)
    return host


def restore(pool, host: SwappedSequence, path: Optional[os.PathLike] = None):
    """A new pool sequence holding what offload() moved out: from host memory, or, with
    path, from the file's bytes (host then only gives the length and block count)."""
    if path is not None:
        data = np.fromfile(path, dtype=np.uint8)
        if data.nbytes != host.nbytes:
            raise ValueError(f"{path}: {data.nbytes:,} bytes, but the copy it stands for "
                             f"holds {host.nbytes:,}")
        host = SwappedSequence(data, host.length, host.n_blocks)
    return pool.swap_in(host)


def _timed(fn, *args, clock=time.process_time):
    started = clock()
    result = fn(*args)
    return result, clock() - started


def measure_tiers(model, tokens: Sequence[int], folder: os.PathLike) -> dict:
    """One round of the chapter's tier comparison for a context of len(tokens) tokens:
    seconds to compute its K and V (a prefill into a pool sequence), to swap them out to
    host memory and back in, and to write them to a file in folder and read them back in,
    with the bytes moved. The sequence restored each way must equal the computed one.
    Computing and copying in memory are the CPU's work: they are timed in CPU seconds
    (time.process_time: with one kvlab thread, what other processes on the machine change
    least); the file's are wall seconds, most of them spent waiting for the disk."""
    tokens = np.asarray(_ids(tokens), np.int64)
    if tokens.size < 2:
        raise ValueError("measure_tiers needs a context of at least 2 tokens")
    pool = model.new_paged_pool(3 * (-(-tokens.size // 16)), 16, prefix_cache=False)
    seq = pool.new_sequence()
    _, compute = _timed(model.forward, tokens[:-1], seq)
    want = model.forward(tokens[-1:], cache=pool.fork(seq))       # the next logits, as computed
    host, out = _timed(offload, pool, seq)
    seq, back = _timed(restore, pool, host)
    path = Path(folder) / "kv_tier.bin"
    try:
        host, write = _timed(offload, pool, seq, path, clock=time.perf_counter)
        seq, read = _timed(restore, pool, host, path, clock=time.perf_counter)
    finally:
        path.unlink(missing_ok=True)
    if not np.array_equal(model.forward(tokens[-1:], cache=seq), want):
        raise AssertionError("the K and V restored from a tier gave other logits")
    return {"tokens": int(tokens.size - 1), "bytes": int(host.nbytes), "compute_s": compute,
            "host_out_s": out, "host_in_s": back, "disk_write_s": write, "disk_read_s": read}


# ---- disaggregated prefill and decode ------------------------------------------------------

class Disaggregated:
    """DistServe's and Splitwise's split, as two kvlab.Engine on virtual clocks (kvlab.slo):
    a prefill engine runs each request's prompt and chooses its first token, then hands it
    to a decode engine, which runs the rest. The hand-off is the kit's preemption by
    swapping: the prefill engine swaps the request out (pool.swap_out: its K and V as bytes,
    its blocks freed), the bytes cross a link of link_bytes_per_s, and the decode engine
    admits it as it admits any swapped request (pool.swap_in into its own pool). So each
    engine is exactly the kit's, the greedy tokens are one engine's, and the only new cost
    is the transfer.

    Time: each engine has its own VirtualClock priced by `cost` (two GPUs, each busy with
    its own steps); the engine whose next step comes first runs first, so a hand-off never
    reaches the decode engine before it left the prefill one. A request's TTFT is the
    prefill engine's, its TPOT the decode engine's, the transfer included."""

    def __init__(self, model, link_bytes_per_s: float, cost=None, num_blocks: int = 512,
                 block_size: int = 16, max_batch_tokens: int = 256):
        self.cost = StepCost.for_model(model) if cost is None else cost
        self.link = Tier("link", link_bytes_per_s)

        def engine():
            return Engine(model, num_blocks=num_blocks, block_size=block_size,
                          max_batch_tokens=max_batch_tokens, preemption="swap",
                          clock=VirtualClock(self.cost))
        self.prefill, self.decode = engine(), engine()
        self.in_flight: List[tuple] = []     # heap of (arrives at, id, request) on the link
        self.moved_bytes = 0
        self.hand_offs = 0

    def run(self, requests: Sequence[tuple]) -> dict:
        """Serve (arrival second, prompt ids, new tokens) requests (kvlab.serving.workload's
        shape); returns every request's RequestOutput by id, from whichever engine it
        finished on."""
        pending = sorted(_checked_requests(requests), key=lambda r: r[0])
        prefill, decode = self.prefill._clock, self.decode._clock
        while pending or self.prefill.has_work or self.in_flight or self.decode.has_work:
            p_next = (prefill() if self.prefill.has_work else
                      pending[0][0] if pending else math.inf)
            d_next = (decode() if self.decode.has_work else
                      self.in_flight[0][0] if self.in_flight else math.inf)
            if p_next <= d_next:
                prefill.wait_until(p_next)
                while pending and pending[0][0] <= prefill():
                    arrival, prompt, new_tokens = pending.pop(0)
                    self.prefill.add_request(prompt, SamplingParams(max_new_tokens=new_tokens),
                                             arrival_time=arrival)
                self.prefill.step()
                self._hand_off_prefilled()
            else:
                decode.wait_until(d_next)
                while self.in_flight and self.in_flight[0][0] <= decode():
                    request = heapq.heappop(self.in_flight)[2]
                    # admitted as any swapped request: swap_in, its copy charged to this clock
                    self.decode.requests[request.id] = request
                    self.decode.scheduler.add(request)
                if self.decode.has_work:
                    self.decode.step()
        return {**self.prefill.outputs, **self.decode.outputs}

    @property
    def seconds(self) -> float:
        """When the later of the two engines finished its last step."""
        return max(self.prefill._clock(), self.decode._clock())

    # [quote ch11-hand-off]
    def _hand_off_prefilled(self) -> None:
        """Every running request of the prefill engine that has its first token leaves it:
        swapped out (its K and V to bytes, its blocks freed), then on the link."""
        engine, clock = self.prefill, self.prefill._clock
        for request in [r for r in engine.scheduler.running
                        if all(s.outputs for s in r.active())]:
            engine.scheduler.preempt(request, engine.space)   # preemption="swap": swap_out
            engine.scheduler.waiting.remove(request)
            del engine.requests[request.id]
            request.preemptions -= 1                          # a hand-off, not a preemption
            nbytes = sum(s.swapped.nbytes for s in request.sequences if s.swapped is not None)
            clock.wait_until(clock() + self.cost.swap_byte_s * nbytes)   # the copy out
            heapq.heappush(self.in_flight,
                           (clock() + self.link.seconds(nbytes), request.id, request))
            self.moved_bytes += nbytes
            self.hand_offs += 1
    # [end ch11-hand-off]


def _checked_requests(requests) -> list:
    """(arrival, prompt, new tokens) triples with arrivals of finite seconds from 0 (the
    engines check the prompts and the counts when the requests are added)."""
    checked = []
    for i, request in enumerate(requests):
        try:
            arrival, prompt, new_tokens = request
        except (TypeError, ValueError):
            raise ValueError(f"request {i} must be (arrival seconds, prompt ids, new tokens), "
                             f"got {request!r}") from None
        checked.append((arguments.real(arrival, f"request {i}'s arrival", low=0.0), prompt,
                        new_tokens))
    return checked


def colocated(model, requests: Sequence[tuple], cost=None, num_blocks: int = 512,
              block_size: int = 16, max_batch_tokens: int = 256):
    """The baseline: the same requests served by one Engine on one VirtualClock (as
    kvlab.serving.serve(clock="virtual") runs them), prefills and decodes sharing its
    steps. Returns (every request's RequestOutput by id, the seconds the run took)."""
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size,
                    max_batch_tokens=max_batch_tokens,
                    clock=VirtualClock(StepCost.for_model(model) if cost is None else cost))
    seconds = _run_virtual(engine, sorted(_checked_requests(requests), key=lambda r: r[0]), None)
    return engine.outputs, seconds


def served(outputs: dict, seconds: float, slo) -> dict:
    """A run's throughput (generated tokens a second) and kvlab.slo.goodput_report's
    goodput, p99 TTFT and TPOT under `slo`."""
    tokens = sum(out.metrics.output_tokens for out in outputs.values())
    return {"tokens_per_s": tokens / seconds, "requests_per_s": len(outputs) / seconds,
            **goodput_report(list(outputs.values()), slo, seconds)}
