"""kvlab.accuracy: what each cache format costs, measured against the fp32 cache."""
import json

import numpy as np
import pytest

import kvlab
from kvlab import accuracy


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


@pytest.fixture(scope="module")
def text_tokens(model):
    # real text the model reads well (not the validation split, which lives outside the repo)
    text = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, "
            "and Juliet is the sun.\n") * 3
    return np.asarray(model.encode(text))


@pytest.fixture(scope="module")
def report(model, text_tokens):
    return accuracy.evaluate(model, text_tokens, context=96)


def test_fp32_against_itself_costs_nothing(report):
    fp32 = report["fp32"]
    assert fp32.kl == 0 and fp32.top1 == 1 and fp32.perplexity_change == 0
    assert max(fp32.key_error) == 0 and max(fp32.value_error) == 0


def test_fewer_bits_cost_more(report, model):
    # the ordering the chapter teaches: each halving of the bits costs accuracy
    error = {f.name: max(f.key_error) for f in report.formats}
    assert 0 < error["fp16"] < error["bf16"] < error["int8 g16"] < error["int4 g16"]
    assert report["fp16"].kl < report["int8 g16"].kl < report["int4 g16"].kl
    assert report["int8 g16"].top1 > 0.95 and abs(report["int8 g16"].perplexity_change) < 0.5
    # fp32 bytes per token is the chapter's formula; int8 adds one scale per head per token
    c = model.config
    assert report["fp32"].bytes_per_token == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 4
    assert report["int8 g16"].bytes_per_token == 2 * c.n_layers * c.n_kv_heads * (c.head_dim + 4)


def test_a_residual_window_buys_back_accuracy(report):
    # same bytes per token; the last 32 positions read exactly
    plain, windowed = report["int4 g16"], report["int4 g16 +w32"]
    assert plain.bytes_per_token == windowed.bytes_per_token
    assert windowed.kl < plain.kl and windowed.top1 >= plain.top1


def test_perplexity_is_computed_from_the_logits(model, text_tokens, report):
    # windows of 96 tokens, each from an empty cache; every token but a window's last
    # is scored on how well it predicts the next one
    nll = []
    for start in range(0, len(text_tokens) - 1, 96):
        window = text_tokens[start:start + 96]
        logits = model.prefill(window, model.new_cache(len(window)), all_logits=True)
        log_p = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
        log_p = log_p - np.log(np.exp(log_p).sum(axis=-1, keepdims=True))
        nll += [-log_p[t, window[t + 1]] for t in range(len(window) - 1)]
    assert report["fp32"].perplexity == pytest.approx(np.exp(np.mean(nll)), rel=1e-9)
    assert report.n_tokens == len(text_tokens)


def test_table_and_json(report, tmp_path):
    table = report.table()
    for f in report.formats:
        assert f.name in table
    path = tmp_path / "accuracy.json"
    report.save_json(str(path))
    data = json.loads(path.read_text())
    assert [f["name"] for f in data["formats"]] == [f.name for f in report.formats]
    assert len(data["formats"][0]["key_error"]) == report.formats[0].key_error.__len__()


def test_bad_arguments(model, text_tokens):
    with pytest.raises(ValueError, match="unknown cache format"):
        accuracy.evaluate(model, text_tokens, ["int3"])
    with pytest.raises(ValueError, match="context"):
        accuracy.evaluate(model, text_tokens, context=10_000)
    with pytest.raises(ValueError, match="at least 2"):
        accuracy.evaluate(model, text_tokens[:1])
    with pytest.raises(KeyError, match="no format"):
        accuracy.evaluate(model, text_tokens[:20], ["fp32"])["int8"]


def test_generated_tokens_are_the_models_own_text(model):
    ids = accuracy.generated_tokens(model, 40, prompt="ROMEO:", seed=3)
    assert len(ids) == 40 and ids.min() >= 0 and ids.max() < model.config.vocab_size
    assert np.array_equal(ids, accuracy.generated_tokens(model, 40, prompt="ROMEO:", seed=3))


def test_validation_split_comes_from_the_model_card(model, shared_models, tmp_path):
    data = shared_models.parent / "data" / "tinyshakespeare.txt"
    if not data.is_file():
        pytest.skip(f"{data} not present")
    ids = accuracy.validation_tokens(model, str(data), 100)
    first = json.loads(kvlab.DEFAULT_MODEL.with_suffix(".json").read_text())["split"]["validation"][0]
    want = model.encode(data.read_bytes()[first:first + 200].decode())[:100]
    assert ids.tolist() == list(want)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match="validation split"):
        accuracy.validation_tokens(model, str(short))


# ---- keeping fewer positions --------------------------------------------------------------

def test_budgets_that_hold_everything_cost_nothing():
    model = kvlab.load()
    tokens = np.arange(128) % 200 + 3
    report = accuracy.evaluate_budgets(model, tokens, budgets=(64, 8), context=64)
    for policy in ("window", "sinks", "h2o", "snapkv"):
        whole, small = report.of(policy)
        assert whole.budget == 64 and whole.kl == 0.0 and whole.top1 == 1.0
        assert whole.perplexity_change == 0.0
        assert small.kl > 0.0
    assert report.n_scored == 64 and report.of("window")[1].mean_rows == 8.0
    assert report.of("snapkv")[1].mean_rows > 8.0      # the cache grows after the prompt
    assert "snapkv" in report.table() and report.as_dict()["results"][0]["policy"] == "window"


@pytest.mark.parametrize("kwargs", [{"policies": ("lru",)}, {"budgets": (0,)},
                                    {"context": 2}, {"context": 10_000}])
def test_evaluate_budgets_refuses_what_it_cannot_run(kwargs):
    model = kvlab.load()
    with pytest.raises(ValueError):
        accuracy.evaluate_budgets(model, np.arange(300) % 200, **kwargs)


# ---- weight formats, and weight x cache formats ----------------------------------------------

@pytest.fixture(scope="module")
def combinations(model, text_tokens):
    return accuracy.evaluate_weights(model, text_tokens, context=96)


def test_float32_weights_with_an_fp32_cache_cost_nothing(combinations):
    exact = combinations["fp32", "fp32"]
    assert exact.kl == 0 and exact.top1 == 1 and exact.perplexity_change == 0
    assert exact.weight_bytes == 4_364_800 and exact.cache_bytes_per_token == 1536


def test_the_weights_and_the_caches_bytes_and_costs(combinations, model):
    fp16, q8 = combinations["fp16", "fp32"], combinations["q8_0 x int8", "fp32"]
    assert fp16.weight_bytes == model.weights.converted("fp16").nbytes
    assert q8.weight_bytes == model.weights.converted("q8_0").nbytes < fp16.weight_bytes
    # fewer weight bits cost more, and a cache's cost adds to the weights'
    assert 0 < fp16.kl < combinations["bf16", "fp32"].kl < q8.kl
    assert combinations["q8_0 x int8", "int4 g16"].kl > combinations["fp32", "int4 g16"].kl * 0.8
    assert q8.top1 > 0.95 and abs(q8.perplexity_change) < 1
    exact_q8 = combinations["q8_0 x fp32", "fp32"]
    assert exact_q8.weight_bytes == q8.weight_bytes and exact_q8.kl < q8.kl
    assert q8.bytes_read(96) == q8.weight_bytes + 96 * 1536
    table = combinations.table()
    assert "q8_0 x int8" in table and "read at 96" in table
    assert json.loads(json.dumps(combinations.as_dict()))["results"][0]["weights"] == "fp32"


def test_evaluate_weights_refuses_what_it_cannot_run(model, text_tokens):
    with pytest.raises(ValueError, match="weight variant"):
        accuracy.evaluate_weights(model, text_tokens, weights=["fp16 x int8"])
    with pytest.raises(ValueError, match="weight variant"):
        accuracy.evaluate_weights(model, text_tokens, weights=["q5_0"])
    with pytest.raises(ValueError, match="context"):
        accuracy.evaluate_weights(model, text_tokens, context=1)


def test_evaluate_weights_takes_the_4_bit_formats(model, text_tokens):
    report = accuracy.evaluate_weights(model, text_tokens[:97],
                                       weights=["q4_1 x int8", "q4_0 x fp32"], caches=["fp32"],
                                       context=96)
    q4_1, q4_0 = report["q4_1 x int8", "fp32"], report["q4_0 x fp32", "fp32"]
    assert q4_1.weight_bytes < q4_0.weight_bytes * 20 / 18 * 1.01 and q4_1.kl > 0 and q4_0.kl > 0


def test_a_change_that_rounds_to_zero_prints_without_a_minus_sign():
    """Issue 22: perplexity 0.0004 % lower printed as "-0.000%"; nothing changed at that
    precision, so it prints "+0.000%". A real decrease keeps its sign."""
    def row(name, change):
        return accuracy.FormatAccuracy(name, 640, [0.0], [0.0], 0.0, 1.0, 2.0, change)
    report = accuracy.AccuracyReport("m", 100, 50, [row("a", -0.00044), row("b", -0.035),
                                                    row("c", 0.0), row("d", 0.2114)])
    lines = report.table().splitlines()[2:6]
    assert [line.split()[-1] for line in lines] == ["+0.000%", "-0.035%", "+0.000%", "+0.211%"]
    assert "-0.000" not in report.table()
