"""Karpathy's trained stories260K (GQA) from ../shared/models: golden greedy output, and
the same logits from its three files (legacy .bin, version 1 .bin, .gguf)."""
import numpy as np
import pytest

import kvlab

# ../shared/models/README.md: greedy, BOS + "Once upon a time", positions 0..127
GOLDEN_IDS = [int(t) for t in """
403 407 261 378 432 383 286 261 376 298 315 421 395 317 426 338 401 396 267 337 410 408 419 292
411 322 265 282 295 433 426 385 328 432 358 394 261 370 432 352 266 268 388 426 338 391 266 267
337 335 312 432 398 312 286 267 414 270 333 415 426 13 438 310 439 419 357 336 432 313 438 310
432 278 316 439 419 298 414 267 265 282 295 433 426 436 317 286 296 418 269 279 292 416 439 413
409 416 327 263 415 294 267 400 426 338 336 432 313 442 391 267 337 335 364 420 268 388 432 398
359 280 303 439 413 272 417 264""".split()]
GOLDEN_TEXT_START = "Once upon a time, there was a little girl named Lily. She loved to play outside"


@pytest.fixture(scope="module")
def stories(shared_models):
    folder = shared_models / "stories260K"
    if not (folder / "stories260K.bin").exists():
        pytest.skip("stories260K not in ../shared/models")
    return folder


def test_greedy_generation_reproduces_the_golden_ids(stories):
    model = kvlab.load(stories / "stories260K.bin", tokenizer=stories / "tok512.bin")
    assert model.encode("Once upon a time") == [1, 403, 407, 261, 378]
    out = kvlab.generate(model, "Once upon a time", max_new_tokens=128 - 4, stop_at_eos=False)
    assert out.prompt_tokens + out.tokens == [1] + GOLDEN_IDS
    assert out.text.startswith(GOLDEN_TEXT_START)


def test_uncached_generation_gives_the_same_text(stories):
    model = kvlab.load(stories / "stories260K.bin", tokenizer=stories / "tok512.bin")
    cached = kvlab.generate(model, "Once upon a time", 60, use_cache=True)
    uncached = kvlab.generate(model, "Once upon a time", 60, use_cache=False)
    assert cached.text == uncached.text and cached.tokens == uncached.tokens


@pytest.mark.parametrize("other", ["stories260K_v1.bin", "stories260K.gguf"])
def test_all_three_files_give_the_same_logits(stories, other):
    pytest.importorskip("gguf") if other.endswith(".gguf") else None
    legacy = kvlab.load(stories / "stories260K.bin", tokenizer=stories / "tok512.bin")
    model = kvlab.load(stories / other, tokenizer=stories / "tok512.bin")
    assert model.config.n_kv_heads == 4 and model.config.n_heads == 8
    tokens = [1] + GOLDEN_IDS[:60]
    np.testing.assert_array_equal(model.forward(tokens, all_logits=True),
                                  legacy.forward(tokens, all_logits=True))
