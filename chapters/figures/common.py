"""What the chapters' figure scripts share: the machine they ran on, and the benchmarks'
own workloads (benchmarks/ is importable from here, so a figure measures exactly what the
benchmark it quotes measures)."""
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import kvlab

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


# GPU figures from the makers' data sheets, which chapters 5 and 7 quote (each script copies
# the ones it uses into its JSON's "facts", with the source).
GPU_FACTS = {
    "h100_hbm_bytes_per_s": {
        "value": 3.35e12,
        "source": "NVIDIA H100 Tensor Core GPU data sheet (references.md, ref-h100), H100 "
                  "SXM: GPU memory bandwidth 3.35 TB/s (HBM3)"},
    "h100_bf16_dense_flops": {
        "value": 989e12,
        "source": "NVIDIA H100 data sheet (ref-h100), H100 SXM: BF16 Tensor Core 1,979 "
                  "TFLOPS 'with sparsity', so 989 TFLOPS dense"},
    "h200_hbm_bytes_per_s": {
        "value": 4.8e12,
        "source": "NVIDIA H200 Tensor Core GPU data sheet (references.md, ref-h200), H200 "
                  "SXM: GPU memory bandwidth 4.8 TB/s (HBM3e)"},
    "h200_bf16_dense_flops": {
        "value": 989e12,
        "source": "NVIDIA H200 data sheet (ref-h200), H200 SXM: BFLOAT16 Tensor Core 1,979 "
                  "TFLOPS 'with sparsity', so 989 TFLOPS dense (the H100's Hopper chip)"},
    "h200_fp32_flops": {
        "value": 67e12,
        "source": "NVIDIA H200 data sheet, H200 SXM: FP32 67 TFLOPS"},
    "h200_sms": {
        "value": 132,
        "source": "NVIDIA Hopper Architecture In-Depth (references.md, ref-hopper): 132 "
                  "streaming multiprocessors in the SXM5 part, which the H200 shares"},
}


def gpu_facts(*names: str) -> dict:
    """The named entries of GPU_FACTS, for a script's own table of facts."""
    return {name: GPU_FACTS[name] for name in names}


def machine() -> dict:
    """The CPU's name, its core count and the software versions, for the JSON's setup."""
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": name or platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "kvlab": kvlab.__version__}


def spread(values) -> dict:
    """The median of repeated measurements and how far they spread: the smallest, the
    largest and the quartiles, with the number of runs. A chapter quotes the median and the
    range, so a reader sees how much a rerun may differ."""
    values = sorted(float(v) for v in values)
    if len(values) < 2:
        raise ValueError("a spread needs at least two runs")
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "min": values[0], "max": values[-1],
            "q1": q1, "q3": q3, "runs": len(values)}


def shared_folder():
    """The course's shared folder (models, data) when it is here: $KVLAB_SHARED, else the
    folder `shared` beside the repository; None when neither exists."""
    for folder in (os.environ.get("KVLAB_SHARED"), Path(__file__).resolve().parents[3] / "shared"):
        if folder and Path(folder, "data").is_dir():
            return Path(folder)
    return None


def english_text(n_chars: int = 20_000):
    """Real English text for the accuracy measurements: the opening n_chars characters of
    tinyshakespeare (shared/data), and where it came from. Without the shared folder (a
    student's clone), the kit's own README stands in, and the name says so: numbers from it
    are not the chapter's."""
    shared = shared_folder()
    if shared is not None and (shared / "data" / "tinyshakespeare.txt").is_file():
        path = shared / "data" / "tinyshakespeare.txt"
        return path.read_text()[:n_chars], "tinyshakespeare.txt"
    readme = Path(__file__).resolve().parents[2] / "README.md"
    return readme.read_text()[:n_chars], "README.md (tinyshakespeare.txt was not found)"


def smollm2(**options):
    """SmolLM2-135M-Instruct, fetched once into the cache (kvlab fetch smollm2-135m)."""
    return kvlab.load("smollm2-135m", **options)


def chosen_sections(parser, text: str, section_keys: dict) -> list:
    """--sections' numbers ("1,3"), sorted; parser.error for any the script does not have."""
    try:
        sections = sorted({int(x) for x in text.split(",")})
    except ValueError:
        sections = []
    if not sections or not set(sections) <= set(section_keys):
        parser.error(f"--sections takes numbers from {sorted(section_keys)}, got {text!r}")
    return sections


def earlier_sections(out: Path, name: str, section_keys: dict, sections) -> tuple:
    """For a script whose sections run separately (--sections): what the sections not run
    this time hold in the NAME.json already in `out`, and when each was run (its
    setup's section_runs). A section that file does not hold must be run: SystemExit."""
    path = out / name
    previous = json.loads(path.read_text()) if path.is_file() else {}
    skipped = [n for n in section_keys if n not in sections]
    missing = [n for n in skipped if any(key not in previous for key in section_keys[n])]
    if missing:
        raise SystemExit(f"{path} holds no earlier run of sections {missing}: run them")
    runs = previous.get("setup", {}).get("section_runs", {})
    return ({key: previous[key] for n in skipped for key in section_keys[n]},
            {n: runs.get(str(n), "an earlier run (when: not recorded)") for n in skipped})
