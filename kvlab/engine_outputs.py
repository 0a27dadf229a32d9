"""What the engine reports: StepResult (one step), RequestOutput (a finished request: one
CompletionOutput per sequence, and its RequestMetrics), in the shape of vLLM's outputs.

Plain records, made by kvlab.engine at the end of a step and by Engine.outputs; nothing
here runs a step or touches the pool. They are importable from kvlab.engine and kvlab too.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from .deprecation import renamed
from .scheduler import State
from .speculative import SpeculationStats


@dataclasses.dataclass
class StepResult:
    """What one engine step did."""
    step: int
    batch_size: int              # sequences in the forward call
    prefill_tokens: int          # prompt (or recomputed) tokens run
    decode_tokens: int           # sequences that fed one generated token (and its drafts)
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    preemptions: int             # requests preempted this step
    prefix_hit_tokens: int       # prompt tokens found in the prefix cache at admission
    admitted: List[int]          # request ids
    finished: List[int]
    new_tokens: Dict[int, List[int]]   # request id -> the tokens chosen, sequence by sequence
                                       # (one each; with speculation, maybe several)
    seconds: float
    failed: Dict[int, str] = dataclasses.field(default_factory=dict)   # id -> why (also finished)
    drafted: int = 0             # speculation: draft tokens run in the forward call
    accepted: int = 0            # drafts the model agreed with (checked this step)
    recomputed_tokens: int = 0   # prefill tokens computed once already, before a preemption
                                 # dropped their K and V (preemption by recompute's cost)
    swapped_out_blocks: int = 0  # preemption by swapping: blocks of K and V copied to host
    swapped_out_bytes: int = 0   # memory (pool.swap_out) and their bytes,
    swapped_in_blocks: int = 0   # and blocks copied back into the pool (pool.swap_in)
    swapped_in_bytes: int = 0
    kv_rows_read: int = 0        # K/V rows attention read (a token at position p reads p + 1)

    @property
    def idle(self) -> bool:
        """Nothing happened: no tokens run or chosen, no request admitted, preempted or done."""
        return not (self.batch_size or self.new_tokens or self.finished or self.admitted
                    or self.preemptions)

    def __str__(self) -> str:
        return (f"step {self.step}: {self.batch_size} seqs, {self.prefill_tokens} prefill + "
                f"{self.decode_tokens} decode tokens"
                + (f" + {self.drafted} drafts ({self.accepted} kept)" if self.drafted else "")
                + f", blocks {self.blocks_used} used / "
                f"{self.blocks_free} free / {self.blocks_cached} cached"
                + (f", {self.preemptions} preempted" if self.preemptions else "")
                + (f", {self.recomputed_tokens} tokens recomputed"
                   if self.recomputed_tokens else "")
                + (f", {self.swapped_out_blocks} blocks swapped out "
                   f"({self.swapped_out_bytes:,} bytes)" if self.swapped_out_blocks else "")
                + (f", {self.swapped_in_blocks} blocks swapped in "
                   f"({self.swapped_in_bytes:,} bytes)" if self.swapped_in_blocks else "")
                + (f", {self.prefix_hit_tokens} prefix-hit tokens" if self.prefix_hit_tokens else "")
                + (f", finished {self.finished}" if self.finished else "")
                + (f", failed {sorted(self.failed)}" if self.failed else ""))


@dataclasses.dataclass(eq=False)
class CompletionOutput:
    """One sequence of a finished request: vLLM's CompletionOutput, in kvlab.Generation's
    words (vLLM's token_ids and text are tokens and completion here)."""
    index: int                   # which sequence of the request (0 .. n - 1)
    tokens: List[int]            # the generated ids, in order
    completion: str              # the generated text alone ("" without a tokenizer)
    finish_reason: str           # "length", "eos", or "error: step N: why" when its next
                                 # token could not be chosen (the request failed)
    speculation: Optional[SpeculationStats] = None   # with speculate=: as Generation's

    def __eq__(self, other) -> bool:
        if isinstance(other, list):                   # outputs[i] == [ids], the old shape
            return list(self._old_shape()) == other
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return ((self.index, self.tokens, self.completion, self.finish_reason)
                == (other.index, other.tokens, other.completion, other.finish_reason))

    # Before issue 19, RequestOutput.outputs[i] was sequence i's token list: reading it as a
    # list still works for a release, and says what to write instead.
    def _old_shape(self) -> List[int]:
        renamed("RequestOutput.outputs[i] as a token list", "RequestOutput.outputs[i].tokens",
                stacklevel=4)
        return self.tokens

    def __iter__(self):
        return iter(self._old_shape())

    def __len__(self) -> int:
        return len(self._old_shape())

    def __getitem__(self, item):
        return self._old_shape()[item]


@dataclasses.dataclass
class RequestMetrics:
    """How long a request took, in the units a user feels (seconds on the engine's clock):
    time to first token (from arrival: queueing and prefill), time per output token after
    it (decode, shared with the batch), and end to end."""
    arrival_time: float
    first_token_time: Optional[float]   # None if it failed before choosing one
    finished_time: float
    output_tokens: int                  # of its longest sequence

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: arrival until the first generated token was chosen."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival until the last token."""
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Time per output token after the first (vLLM's TPOT): (e2e - ttft) / (tokens - 1);
        None for fewer than two tokens."""
        if self.first_token_time is None or self.output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.output_tokens - 1)


@dataclasses.dataclass
class RequestOutput:
    """A finished request: its prompt ids and one CompletionOutput per sequence (n of them),
    the shape of vLLM's RequestOutput."""
    id: int
    prompt: List[int]
    outputs: List[CompletionOutput]
    preemptions: int
    # with speculate=: its sequences' counts added up (SpeculationStats.total)
    speculation: Optional[SpeculationStats] = dataclasses.field(default=None, compare=False)
    # when it arrived, got its first token and finished (engine clock): TTFT, TPOT, e2e
    metrics: Optional[RequestMetrics] = dataclasses.field(default=None, compare=False)

    @property
    def texts(self) -> List[str]:
        renamed("RequestOutput.texts", "[o.completion for o in RequestOutput.outputs]")
        return [o.completion for o in self.outputs]

    @property
    def finish_reasons(self) -> List[str]:
        renamed("RequestOutput.finish_reasons",
                "[o.finish_reason for o in RequestOutput.outputs]")
        return [o.finish_reason for o in self.outputs]


class FinishedOutputs(dict):
    """Engine.outputs: a dict of the finished requests' outputs whose missing keys say
    why (a request still waiting or running, or no such request)."""

    def __init__(self, states: Dict[int, State]):
        super().__init__()
        self._states = states

    def __missing__(self, rid):
        state = self._states.get(rid)
        if state is None:
            raise KeyError(f"no request {rid!r} was added to this engine")
        raise KeyError(f"request {rid} is not finished yet ({state.value}): step() "
                       f"until it is, or run() to finish every request")


def request_output(request, model, draft_tokens: Optional[int]) -> RequestOutput:
    """A finished request's RequestOutput (its text decoded where the model has a
    tokenizer; speculation's counts where the engine speculated: draft_tokens not None)."""
    outputs = [CompletionOutput(s.index, list(s.outputs),
                                model.decode_text(s.outputs) if model.tokenizer is not None else "",
                                s.finish_reason, s.stats)
               for s in request.sequences]
    total = (SpeculationStats.total([o.speculation for o in outputs], draft_tokens)
             if draft_tokens is not None else None)
    finished_at = request.arrived if request.finished_at is None else request.finished_at
    metrics = RequestMetrics(request.arrived, request.first_token_at, finished_at,
                             max(len(o.tokens) for o in outputs))
    return RequestOutput(request.id, request.prompt, outputs, request.preemptions, total, metrics)
