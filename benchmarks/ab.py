"""Before against after, on a noisy machine: two (or more) builds of kvlab timed in turn.

On a shared machine the memory bandwidth and the clock move by 10-30 % from one minute to
the next, so two runs made a minute apart cannot tell a 10 % change from the weather. This
script keeps a copy of the built package per version and runs a timing script under each
copy in turn, round after round, so every version meets the same conditions, and reports
the best value of each figure per version.

    python setup.py build_ext --inplace && python benchmarks/ab.py save before
    # ... change csrc/, build again ...
    python setup.py build_ext --inplace && python benchmarks/ab.py save after
    python benchmarks/ab.py run my_timing.py before after [--rounds 5]

The timing script prints lines "name value", higher is better (tokens/s, GB/s); anything
else it prints is ignored. The copies live in build/ab/ (not tracked).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORE = REPO / "build" / "ab"


def save(name: str) -> Path:
    """Copies the package as built now (kvlab/, with its compiled extensions) to STORE/name."""
    if not any((REPO / "kvlab").glob("_kvlab*.so")):
        raise SystemExit("kvlab is not built in place: run python setup.py build_ext --inplace")
    target = STORE / name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(REPO / "kvlab", target / "kvlab",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return target


def parse_figures(output: str) -> dict:
    """The "name value" lines of a timing script's output."""
    figures = {}
    for line in output.splitlines():
        name, _, value = line.rpartition(" ")
        try:
            figures[name.strip()] = float(value)
        except ValueError:
            continue
    return {name: value for name, value in figures.items() if name}


def run(script: Path, names: list, rounds: int) -> dict:
    """{figure: {version: best value}}, each version run once per round, in turn."""
    best: dict = {}
    for _ in range(rounds):
        for name in names:
            # the saved copy first on the path, then the script's own folder (for its
            # imports of sibling modules): -P keeps Python from putting that folder first,
            # where a kvlab/ beside the script (the repository's, run from the root) would
            # win and every version would time the same build
            path = [str(STORE / name), str(script.parent), os.environ.get("PYTHONPATH", "")]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
            done = subprocess.run([sys.executable, "-P", str(script)], env=env,
                                  capture_output=True, text=True, cwd=STORE)
            if done.returncode != 0:
                raise SystemExit(f"{script} failed under {name}:\n{done.stderr[-2000:]}")
            for figure, value in parse_figures(done.stdout).items():
                versions = best.setdefault(figure, {})
                versions[name] = max(versions.get(name, float("-inf")), value)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    keep = commands.add_parser("save", help="keep a copy of the package as built now")
    keep.add_argument("name")
    timing = commands.add_parser("run", help="run a timing script under saved copies in turn")
    timing.add_argument("script", type=Path)
    timing.add_argument("names", nargs="+")
    timing.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.command == "save":
        print(f"saved {save(args.name)}")
        return
    missing = [name for name in args.names if not (STORE / name / "kvlab").is_dir()]
    if missing:
        raise SystemExit(f"no saved copy named {', '.join(missing)} (python benchmarks/ab.py save NAME)")
    best = run(args.script.resolve(), args.names, args.rounds)
    first = args.names[0]
    print(f"best of {args.rounds} rounds, the versions in turn; ratios against {first}")
    width = max([len(figure) for figure in best] + [6])
    print(f"{'':<{width}}" + "".join(f"{name:>18}" for name in args.names))
    for figure, versions in best.items():
        cells = []
        for name in args.names:
            value = versions.get(name)
            ratio = f" ({value / versions[first]:.2f}x)" if value and versions.get(first) else ""
            cells.append(f"{value:,.1f}{ratio}" if value is not None else "-")
        print(f"{figure:<{width}}" + "".join(f"{cell:>18}" for cell in cells))


if __name__ == "__main__":
    main()
