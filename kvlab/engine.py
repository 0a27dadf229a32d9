"""kvlab.Engine: continuous batching on the paged KV cache.

"Every active conversation carries its own cache." The engine serves many requests at
once from one paged pool: each step, the scheduler (kvlab.scheduler) picks which
sequences run and with how many tokens, and the engine runs them all in ONE batched
forward call (Model.forward_batch: every weight matrix streamed once per 48 tokens),
then samples each sequence's next token. Requests join and leave between steps:
continuous batching.

    engine = kvlab.Engine(model, model.new_paged_pool(num_blocks=256, block_size=16))
    engine.add_request("ROMEO:", kvlab.SamplingParams(max_tokens=40))
    while engine.has_work:
        print(engine.step())              # what happened: batch, tokens, blocks, preemptions
    engine.outputs                        # every request's generated tokens and text

Greedy outputs are identical, token for token, to kvlab.generate on each prompt alone,
whatever else is in the batch and however often a request was preempted: the core's
results for a sequence do not depend on the batch around it (fp32 and every cache format).
This file is bookkeeping; no tensor is touched here.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from .model import Model, as_token_array
from .paged import PagedPool
from .sampling import sample as sample_token
from .scheduler import Request, Sample, SamplingParams, Scheduler, State, requests_fit


@dataclasses.dataclass
class StepResult:
    """What one engine step did."""
    step: int
    batch_size: int              # sequences in the forward call
    prefill_tokens: int          # prompt (or recomputed) tokens run
    decode_tokens: int           # sequences that fed one generated token
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    preemptions: int             # requests preempted this step
    prefix_hit_tokens: int       # prompt tokens found in the prefix cache at admission
    admitted: List[int]          # request ids
    finished: List[int]
    new_tokens: Dict[int, List[int]]   # request id -> the token sampled for each sample
    seconds: float

    def __str__(self) -> str:
        return (f"step {self.step}: {self.batch_size} seqs, {self.prefill_tokens} prefill + "
                f"{self.decode_tokens} decode tokens, blocks {self.blocks_used} used / "
                f"{self.blocks_free} free / {self.blocks_cached} cached"
                + (f", {self.preemptions} preempted" if self.preemptions else "")
                + (f", {self.prefix_hit_tokens} prefix-hit tokens" if self.prefix_hit_tokens else "")
                + (f", finished {self.finished}" if self.finished else ""))


@dataclasses.dataclass
class RequestOutput:
    id: int
    prompt: List[int]
    outputs: List[List[int]]     # one token list per sample
    texts: List[str]             # decoded, when the model has a tokenizer
    finish_reasons: List[str]    # "length" or "eos" per sample
    preemptions: int


class _PoolSpace:
    """The scheduler's view of the pool (kvlab.scheduler.BlockSpace)."""

    def __init__(self, pool: PagedPool):
        self.pool = pool

    def available(self) -> int:
        return self.pool.available_blocks

    def sequences_left(self) -> int:
        return self.pool.max_seqs - self.pool.live_sequences

    def needed(self, sample: Sample, n_tokens: int) -> int:
        if sample.seq is None:
            return -(-n_tokens // self.pool.block_size)
        return self.pool.blocks_needed(sample.seq, n_tokens)

    def start(self, request: Request) -> int:
        hits = 0
        for sample in request.active():
            sample.seq = self.pool.new_sequence()
            # at least the last token is computed: its logits choose the next token
            reusable = np.asarray(sample.tokens[:-1], dtype=np.int32)
            sample.computed = self.pool.reuse_prefix(sample.seq, reusable) if len(reusable) else 0
            hits += sample.computed
        return hits

    def release(self, request: Request) -> None:
        for sample in request.samples:
            if sample.seq is not None:
                self.pool.free(sample.seq)
                sample.seq = None


class _BlockTracer:
    """Block events for a notebook to replay, found by comparing the pool before and after
    each phase of a step:
      allocated  a free block (or an evicted cached one) starts holding a sequence's rows
      shared     one more sequence uses a block: a fork, a prefix-cache hit, or a block the
                 pool found it had computed twice ("replaces": the duplicate, then freed)
      copied     copy-on-write: a sequence's shared, partly filled block copied to a new one
      released   one sequence fewer uses a block that others still use ("refs" left)
      freed      no sequence uses a block any more ("to": the prefix cache, or the free list)
      evicted    a cached block dropped from the prefix cache to be reused."""

    def __init__(self, pool: PagedPool, sink):
        self.pool, self.sink = pool, sink
        self.before = self._state()

    def _state(self):
        # (id, serial) names a sequence for good: a freed slot's id is reused
        tables = {(seq.id, seq.serial): seq.block_table.tolist() for seq in self.pool.sequences()}
        return self.pool.ref_counts.copy(), set(self.pool.cached_blocks), tables

    def record(self, step: int, phase: str) -> None:
        (refs0, cached0, tables0), (refs1, cached1, tables1) = self.before, self._state()
        events, explained = [], set()
        for seq, table in tables1.items():
            for i, (old, new) in enumerate(zip(tables0.get(seq, []), table)):
                if old == new:
                    continue
                explained.add(new)
                if refs1[old] > 0:                   # the old block is still someone's
                    if new in cached0:
                        events.append({"event": "evicted", "block": new})
                    events.append({"event": "copied", "block": new, "from": old,
                                   "refs": int(refs1[new]), "seq": seq[0], "index": i})
                else:
                    events.append({"event": "shared", "block": new, "refs": int(refs1[new]),
                                   "replaces": old, "seq": seq[0], "index": i})
        for block in np.flatnonzero(refs0 != refs1).tolist():
            before, after = int(refs0[block]), int(refs1[block])
            if block in explained:
                continue
            if before == 0 and after > 0:
                if block in cached0 and phase == "admit":
                    events.append({"event": "shared", "block": block, "refs": after,
                                   "prefix_hit": True})
                else:
                    if block in cached0:
                        events.append({"event": "evicted", "block": block})
                    events.append({"event": "allocated", "block": block, "refs": after})
            elif after > before:
                events.append({"event": "shared", "block": block, "refs": after})
            elif after == 0:
                events.append({"event": "freed", "block": block,
                               "to": "cached" if block in cached1 else "free"})
            else:                                    # one user fewer, others remain
                events.append({"event": "released", "block": block, "refs": after})
        for block in sorted(cached0 - cached1):
            if refs1[block] == 0 and block not in explained:   # dropped, not reused
                events.append({"event": "evicted", "block": block})
        for event in events:
            self.sink({"step": step, "phase": phase, **event})
        self.before = (refs1, cached1, tables1)


class Engine:
    """Continuous batching of many requests over one paged pool (see the module text)."""

    def __init__(self, model: Model, pool: PagedPool, max_batch_tokens: int = 256,
                 max_batch_seqs: Optional[int] = None,
                 trace: Union[None, str, Path, list] = None):
        self.model, self.pool = model, pool
        self.scheduler = Scheduler(pool.block_size, max_batch_tokens,
                                   min(max_batch_seqs or pool.max_seqs, pool.max_seqs))
        self.space = _PoolSpace(pool)
        self.requests: Dict[int, Request] = {}
        self.metrics: List[StepResult] = []
        self._next_id = 0
        # One step at a time: calls from several threads are serialized, not interleaved
        # (the queues and the pool change together within a step).
        self._lock = threading.RLock()
        self._eos = getattr(model.tokenizer, "eos_id", None)
        self._trace_file = None
        self._tracer = None
        if trace is not None:
            if isinstance(trace, list):
                sink = trace.append
            else:
                self._trace_file = open(trace, "w")
                sink = lambda event: self._trace_file.write(json.dumps(event) + "\n")  # noqa: E731
            self._tracer = _BlockTracer(pool, sink)

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, prompt: Union[str, Sequence[int]],
                    params: Optional[SamplingParams] = None) -> int:
        """Queue a request; returns its id. Raises ValueError at once if it could never
        fit the pool, even running alone."""
        with self._lock:
            return self._add_request(prompt, params)

    def _add_request(self, prompt, params) -> int:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a kvlab.SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            ids = self.model.encode(prompt)
            if not ids:
                raise ValueError("the prompt has no tokens")
        else:
            ids = as_token_array(prompt, self.model.config.vocab_size).tolist()  # checks ids
        context = self.model.config.max_seq_len
        if len(ids) + params.max_tokens > context:
            raise ValueError(f"request rejected: prompt ({len(ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds the model's context of {context}")
        why = requests_fit(len(ids), params, self.pool.block_size, self.pool.num_blocks,
                           self.pool.max_blocks_per_seq)
        if why is not None:
            raise ValueError(f"request rejected: {why}")
        if params.n > self.pool.max_seqs:
            raise ValueError(f"request rejected: n={params.n} samples need as many sequences; "
                             f"the pool allows max_seqs={self.pool.max_seqs}")
        request = Request(id=self._next_id, prompt=list(ids), params=params, arrival=self._next_id)
        for i in range(params.n):
            rng = np.random.default_rng(None if params.seed is None else params.seed + i)
            request.samples.append(Sample(index=i, tokens=list(ids), prompt_len=len(ids), rng=rng))
        self.requests[request.id] = request
        self.scheduler.add(request)
        self._next_id += 1
        return request.id

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule, run one batched forward call, sample; returns what happened. Steps
        asked for by several threads at once run one after the other."""
        with self._lock:
            return self._step()

    def _step(self) -> StepResult:
        start = time.perf_counter()
        step_number = self.scheduler.step_count
        decision = self.scheduler.schedule(self.space)
        self._trace(step_number, "admit")
        new_tokens: Dict[int, List[int]] = {}
        finished: List[int] = []
        prefill = decode = 0
        if decision.items:
            seqs = [sample.seq for _, sample, _ in decision.items]
            chunks = [sample.tokens[sample.computed:sample.computed + n]
                      for _, sample, n in decision.items]
            logits = self.model.forward_batch(seqs, chunks)
            self._trace(step_number, "forward")
            for (request, sample, n), row in zip(decision.items, logits):
                if sample.pending == 1 and sample.computed >= sample.prompt_len:
                    decode += 1
                else:
                    prefill += n
                sample.computed += n
                if sample.computed < len(sample.tokens):
                    continue                       # a prompt chunk: no token to choose yet
                for chosen in self._choose(request, sample, row):
                    new_tokens.setdefault(request.id, []).append(chosen)
            for request in {r.id: r for r, _, _ in decision.items}.values():
                if request.finished and request.state is State.RUNNING:
                    self.space.release(request)
                    self.scheduler.finish(request)
                    finished.append(request.id)
            self._trace(step_number, "sample")
        stats = self.pool.stats()
        result = StepResult(step=step_number, batch_size=len(decision.items),
                            prefill_tokens=prefill, decode_tokens=decode,
                            blocks_used=stats.blocks_used, blocks_free=stats.blocks_free,
                            blocks_cached=stats.blocks_cached,
                            preemptions=len(decision.preempted),
                            prefix_hit_tokens=decision.prefix_hit_tokens,
                            admitted=[r.id for r in decision.admitted], finished=finished,
                            new_tokens=new_tokens, seconds=time.perf_counter() - start)
        self.metrics.append(result)
        return result

    def _choose(self, request: Request, sample: Sample, logits: np.ndarray) -> List[int]:
        """Sample the next token of `sample`; at the end of a prompt with n > 1, first fork
        it into the request's other samples, each choosing from the same logits."""
        p = request.params
        targets = [sample]
        if not request.forked and p.n > 1:
            for other in request.samples[1:]:
                other.seq = self.pool.fork(sample.seq)        # shares every block
                other.computed = sample.computed
            request.forked = True
            targets = request.samples
        chosen = []
        for target in targets:
            token = sample_token(logits, p.temperature, p.top_k, p.top_p, target.rng)
            if p.stop_at_eos and self._eos is not None and token == self._eos:
                target.finished, target.finish_reason = True, "eos"
            else:
                target.tokens.append(token)
                chosen.append(token)
                if len(target.outputs) >= p.max_tokens:
                    target.finished, target.finish_reason = True, "length"
            if target.finished and target.seq is not None:
                self.pool.free(target.seq)                    # its blocks are free now
                target.seq = None
        return chosen

    def _trace(self, step: int, phase: str) -> None:
        if self._tracer is not None:
            self._tracer.record(step, phase)

    # ---- all of it --------------------------------------------------------------------
    def run(self, progress: bool = True) -> Dict[int, RequestOutput]:
        """Step until every request is finished; returns their outputs by request id."""
        bar = None
        if progress:
            from tqdm.auto import tqdm
            total = sum(r.params.max_tokens * r.params.n for r in self.requests.values()
                        if r.state is not State.FINISHED)
            bar = tqdm(total=total, desc="engine", unit="tok")
        while self.has_work:
            result = self.step()
            if bar is not None:
                bar.update(sum(len(t) for t in result.new_tokens.values()))
                bar.set_postfix(batch=result.batch_size, blocks=result.blocks_used, refresh=False)
        if bar is not None:
            bar.close()
        if self._trace_file is not None:
            self._trace_file.flush()
        return self.outputs

    @property
    def outputs(self) -> Dict[int, RequestOutput]:
        """Every finished request's output, by id."""
        done = {}
        for request in self.requests.values():
            if request.state is not State.FINISHED:
                continue
            outputs = [s.outputs for s in request.samples]
            texts = ([self.model.decode_text(o) for o in outputs]
                     if self.model.tokenizer is not None else ["" for _ in outputs])
            done[request.id] = RequestOutput(request.id, request.prompt, outputs, texts,
                                             [s.finish_reason for s in request.samples],
                                             request.preemptions)
        return done

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Close the trace file, if trace= named one (also done by `with Engine(...)`)."""
        if self._trace_file is not None:
            self._trace_file.close()
            self._trace_file = None
