"""Feedback that finds the bug: what a failed check says must point at the mistake made,
and only at it. Planted mistakes (instructor/mistakes/) run through the public checks, whose
messages students see first; a hint tied to one mistake must not show for another; token
lists are shown as the first token that differs, with text; the speculative lab's model says
when a cache overflows for want of a rollback.

The hidden tests' side (each mistake fails the tests that name it, and no others) is in
test_grading.py, which runs every file of instructor/mistakes/.
"""
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("kvlab._kvlab")
from kvlab.grading import check  # noqa: E402
from kvlab.grading.testkit import check_close, check_tokens  # noqa: E402

INSTRUCTOR = Path(__file__).resolve().parents[1] / "instructor"


def with_mistake(tmp_path, lab, code):
    """The reference solution with `code` after it (a later def replaces an earlier one)."""
    path = tmp_path / f"{lab}.py"
    path.write_text((INSTRUCTOR / "solutions" / f"{lab}.py").read_text() + "\n\n" + code)
    return path


def planted(lab, name):
    return (INSTRUCTOR / "mistakes" / lab / f"{name}.py").read_text()


def outputs(report):
    return {t.function: t for t in report.tests}


# ---- the pieces -------------------------------------------------------------------------

def test_a_hint_shows_only_when_the_result_matches_its_mistake():
    want = np.ones(3)
    with pytest.raises(AssertionError) as caught:
        check_close(want * 2, want, "x", hints=[(want * 3, "HINT-3"), (want * 2, "HINT-2")])
    assert str(caught.value).endswith(": HINT-2") and "HINT-3" not in str(caught.value)
    with pytest.raises(AssertionError) as caught:
        check_close(want * 5, want, "x", hints=[(want * 2, "HINT-2")])
    assert "HINT" not in str(caught.value)
    check_close(want, want, "x", hints=[(want, "HINT")])         # a pass says nothing


def test_token_lists_are_shown_from_the_first_difference_with_their_text():
    text = lambda ids: "".join(chr(ord("a") + i % 26) for i in ids)     # noqa: E731
    want = list(range(24))
    with pytest.raises(AssertionError) as caught:
        check_tokens(want[:10] + [25] * 14, want, "24 tokens", text=text)
    message = str(caught.value)
    assert "from token 10 on" in message and "'klmnopqrstuvwx'" in message, message
    assert str(want) not in message                       # never the two whole lists
    with pytest.raises(AssertionError) as caught:
        check_tokens(want[:5], want, "24 tokens")
    assert "from token 5 on (5 tokens where 24 are expected)" in str(caught.value)
    with pytest.raises(AssertionError, match="expected a list of 24 token ids"):
        check_tokens("abc", want, "24 tokens")
    check_tokens(np.arange(24), want, "24 tokens")


# ---- own_cache's public checks ----------------------------------------------------------

POSITION_HINT = "its position is cache.length, 6, not 0"

WRONG_SCALE = '''
_scaled = attention


def attention(q, keys, values, positions):
    return _scaled(q * np.float32(math.sqrt(q.shape[-1])), keys, values, positions)   # no scale at all
'''


def test_own_cache_the_position_hint_shows_for_a_position_mistake_only(tmp_path):
    report = check("own_cache", with_mistake(tmp_path, "own_cache", planted("own_cache", "positions_from_zero")))
    decode = outputs(report)["test_one_decode_step_after_a_prefill"]
    assert not decode.passed and POSITION_HINT in decode.output, decode.output
    report = check("own_cache", with_mistake(tmp_path, "own_cache", WRONG_SCALE))
    decode = outputs(report)["test_one_decode_step_after_a_prefill"]
    assert not decode.passed and POSITION_HINT not in decode.output, decode.output


def test_own_cache_an_average_step_time_fails_a_public_check(tmp_path):
    average = ('_each = step_seconds\n\n\ndef step_seconds(model, prompt, n_new, use_cache):\n'
               '    times = _each(model, prompt, n_new, use_cache)\n'
               '    return [sum(times) / n_new] * n_new\n')
    report = check("own_cache", with_mistake(tmp_path, "own_cache", average))
    assert report.failed() == ["test_step_seconds_times_each_step"], report.summary()
    output = outputs(report)["test_step_seconds_times_each_step"].output
    assert "the same" in output and "time each step itself" in output, output


def test_own_cache_wrong_tokens_are_shown_as_text(tmp_path):
    wrong = ('_right = generate\n\n\ndef generate(model, prompt, n_new, use_cache=True):\n'
             '    tokens, logits = _right(model, prompt, n_new, use_cache)\n'
             '    return tokens[:2] + [int(t) + 1 for t in tokens[2:]], logits\n')
    report = check("own_cache", with_mistake(tmp_path, "own_cache", wrong))
    output = outputs(report)["test_five_greedy_tokens_with_the_cache"].output
    assert "from token 2 on" in output and "'" in output, output


# ---- paged_attention's public checks ------------------------------------------------------

@pytest.mark.parametrize("mistake, hint", [
    ("head_mapping_swapped", "reading KV head h % 2"),
    ("scale_by_head_dim", "scores divided by head_dim"),
    ("reads_whole_blocks", "rows past the length (7) are stale")])
def test_paged_attention_public_checks_catch_attention_mistakes_and_name_them(tmp_path, mistake, hint):
    """A swapped GQA head mapping and a wrong scale passed the public checks (a query of
    zeros) 3/3: the GQA check with a real query fails them, each with its own hint."""
    report = check("paged_attention", with_mistake(tmp_path, "paged_attention", planted("paged_attention", mistake)))
    failed = outputs(report)["test_gqa_attention_with_a_query"]
    assert not failed.passed and hint in failed.output, report.summary()
    others = ("reading KV head", "divided by head_dim", "unscaled", "are stale")
    assert [h for h in others if h in failed.output] == [h for h in others if h in hint], failed.output


def test_paged_attention_the_stale_row_hint_shows_only_for_stale_rows(tmp_path):
    report = check("paged_attention", with_mistake(tmp_path, "paged_attention", planted("paged_attention", "reads_whole_blocks")))
    equal = outputs(report)["test_equal_scores_average_the_values"]
    assert not equal.passed and "past the length" in equal.output, equal.output
    unscaled = ("_scaled = paged_attend\n\n\ndef paged_attend(q, *rest):\n"
                "    return _scaled(q * np.float32(math.sqrt(q.shape[-1])), *rest)   # no scale at all\n")
    report = check("paged_attention", with_mistake(tmp_path, "paged_attention", unscaled))
    assert outputs(report)["test_equal_scores_average_the_values"].passed    # q = 0: no scale
    assert not outputs(report)["test_gqa_attention_with_a_query"].passed


# ---- speculative_decoding ---------------------------------------------------------------

def test_a_cache_full_of_rejected_drafts_points_at_rollback():
    """A loop without rollback overflows its cache: the message must name the pass whose
    rejected drafts stayed, and the rollback, not a larger max_seq_len."""
    from kvlab.errors import CacheFullError
    from kvlab.grading.served import ServedModel
    model = ServedModel()
    prompt = model.encode("ROMEO:\nBut soft")
    cache = model.new_cache(len(prompt) + 8)
    newest = int(np.argmax(model.forward(prompt, cache)))
    wrong = (newest + 1) % 256                    # the bundled model has 256 tokens (bytes)
    with pytest.raises(CacheFullError) as caught:
        for _ in range(4):                       # 1 + 3 drafts a pass, never rolled back
            model.forward([newest, wrong, wrong, wrong], cache, all_logits=True)
    message = str(caught.value)
    assert "rejected drafts' K and V stayed" in message and "cache.truncate" in message, message
    assert f"should have held {len(prompt) + 1}" in message, message
    assert "larger max_seq_len" not in message
    # a cache too small for what is asked of it, with nothing rolled back wrong: the message
    # asks about the loop, and names no pass
    cache = model.new_cache(len(prompt))
    model.forward(prompt, cache)
    with pytest.raises(CacheFullError) as caught:
        model.forward([newest], cache)
    assert "rollback" in str(caught.value) and "stayed in it" not in str(caught.value)


def test_speculative_public_tokens_are_shown_as_text(tmp_path):
    wrong = ('_right = generate_speculative\n\n\n'
             'def generate_speculative(model, prompt, n_new, k=4, max_ngram=3):\n'
             '    tokens, stats = _right(model, prompt, n_new, k, max_ngram)\n'
             '    return tokens[:20] + [32] * (n_new - 20), stats\n')
    report = check("speculative_decoding", with_mistake(tmp_path, "speculative_decoding", wrong))
    output = outputs(report)["test_speculation_keeps_plain_decodings_tokens"].output
    assert "your tokens differ from token" in output and "'" in output, output
    assert output.count(",") < 40, output                 # not two lists of 24 numbers
