"""How kvlab.Engine cuts a decode step into forward calls: each call streams every weight
matrix once, so one-token feeds join a call until it holds CHUNK_MIN tokens, whatever
their work (kvlab/engine.py's _next_call). A decode batch of SmolLM2's 32 sequences is
about 8.6 GFLOP, over CHUNK_FLOPS; cut by work alone it made five calls and read the
weights five times, which undid what batching is for (chapter 5). Checked on the bundled
model with the calls shrunk, never timed.
"""
from __future__ import annotations

import pytest

import kvlab
import kvlab.engine
from kvlab import SamplingParams
from kvlab.measure import work_rates


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


def decode_calls(model, monkeypatch, n_seqs: int, chunk_min: int) -> list:
    """The token count of each forward call of the decode steps of n_seqs requests run
    together, with calls of about 9 tokens' work and at least chunk_min tokens."""
    per_token, _ = work_rates(model.config)
    monkeypatch.setattr(kvlab.engine, "CHUNK_FLOPS", 9 * per_token)
    monkeypatch.setattr(kvlab.engine, "CHUNK_MIN", chunk_min)
    engine = kvlab.Engine(model, model.new_paged_pool(num_blocks=2 * n_seqs + 4, block_size=16),
                          max_batch_tokens=512)
    for i in range(n_seqs):
        engine.add_request([1 + i, 2, 3], SamplingParams(max_new_tokens=3, stop_at_eos=False))
    inner, calls = engine.model.forward_batch, []

    def recording(handles, chunks, all_logits=False):
        calls.append(sum(len(c) for c in chunks))
        return inner(handles, chunks, all_logits=all_logits)

    engine.model.forward_batch = recording
    try:
        per_step = []
        while engine.has_work:
            calls.clear()
            step = engine.step()
            if step.prefill_tokens == 0 and step.decode_tokens == n_seqs:
                per_step.append(list(calls))
    finally:
        del engine.model.__dict__["forward_batch"]
    assert per_step, "no decode step ran all the sequences together"
    return per_step


def test_a_decode_batch_over_the_work_limit_is_one_call_below_chunk_min(model, monkeypatch):
    # 12 one-token feeds are 12 tokens' work, over the 9 a call holds, but under 16 tokens
    for calls in decode_calls(model, monkeypatch, n_seqs=12, chunk_min=16):
        assert calls == [12]


def test_a_decode_batch_is_cut_in_calls_of_chunk_min_tokens(model, monkeypatch):
    # 20 one-token feeds: 16 fill the first call (more than 9 tokens' work), 4 the next
    for calls in decode_calls(model, monkeypatch, n_seqs=20, chunk_min=16):
        assert calls == [16, 4]
