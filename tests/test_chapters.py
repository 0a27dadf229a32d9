"""The chapters (chapters/*.md) stay true to the repository: every quoted piece of code
still exists where the chapter says, every figure is made by the chapter's script, and
every linked notebook and lab exists. The figure scripts themselves run here too."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chapter_files import CHAPTERS, REPO, SLUGS, chapter_text, directives

# chapters whose every decimal number and percentage in the prose is checked against the
# figure script's JSON (test_prose_numbers_come_from_the_json)
NUMBERS_FROM_JSON = [
    "01_kv_cache",
    "02_cache_size",
    "03_gqa",
    "04_paged",
    "05_batching",
    "06_quantization",
    "07_gpu_kernels",
    "08_fewer_positions",
    "09_speculative",
    "10_weight_quantization",
    "11_serving_at_scale",
]
# The units a number of the JSON may be shown in: as stored, per thousand (ms from s, GB
# from MB), per million, billion or trillion (M parameters, GFLOP, TFLOP), per KiB, MiB or
# GiB (bytes shown in binary units), or in thousands (ms from seconds).
UNIT_SCALES = (1, 1e3, 1e-3, 1e-6, 1e-9, 1e-12, 2.0 ** -10, 2.0 ** -20, 2.0 ** -30)

@pytest.mark.parametrize("slug", SLUGS)
def test_the_chapter_and_its_notebook_exist(slug):
    text = chapter_text(slug)
    number = int(slug[:2])
    assert re.search(rf"^# {number}\. ", text, re.M), f"{slug}.md has no '# {number}. Title' heading"
    assert f"../notebooks/{slug}.ipynb" in text, f"{slug}.md does not link its notebook"
    assert (REPO / "notebooks" / f"{slug}.ipynb").is_file()


MARKER = re.compile(r"\[(quote|end) (ch\d\d-[a-z0-9-]+)\]")


@pytest.mark.parametrize("slug", SLUGS)
def test_quoted_code_is_marked_in_the_source(slug):
    """Every quote starts after a "[quote NAME]" comment and ends before "[end NAME]" in the
    quoted file, so an edit to the code around it cannot move it silently, and a reader of
    the code sees which chapter quotes what."""
    includes = directives(chapter_text(slug), "literalinclude")
    assert includes, f"{slug}.md quotes no code from the kit"
    for path, options in includes:
        source = (CHAPTERS / path).resolve()
        assert source.is_file() and REPO in source.parents, f"{slug}: {path} is not a file of the kit"
        assert options.get("caption"), f"{slug}: the quote from {path} has no caption"
        start, end = options.get("start-after", ""), options.get("end-before", "")
        assert not {"start-at", "end-at", "lines"} & set(options), \
            f"{slug}: quote {path} must use markers (:start-after: and :end-before:)"
        begin, finish = MARKER.fullmatch(start), MARKER.fullmatch(end)
        assert begin and begin[1] == "quote" and finish and finish[1] == "end" \
            and begin[2] == finish[2], f"{slug}: quote {path} must be [quote NAME] .. [end NAME]"
        text = source.read_text()
        assert text.count(start) == 1 and text.count(end) == 1, \
            f"{slug}: {path} must hold {start!r} and {end!r} once each"
        body = text[text.index(start):text.index(end)]
        assert text.index(start) < text.index(end) and body.count("\n") > 1, \
            f"{slug}: {path}: {start!r} must come before {end!r}, with code between"
        assert not MARKER.search(body[len(start):]), \
            f"{slug}: the quote {start!r} of {path} holds another quote's marker"


def test_every_marker_in_the_kit_is_quoted_by_a_chapter():
    quoted = set()
    for slug in SLUGS:
        for _, options in directives(chapter_text(slug), "literalinclude"):
            quoted.add(options.get("start-after"))
    sources = [p for folder in ("csrc", "kvlab") for p in (REPO / folder).rglob("*")
               if p.suffix in (".c", ".h", ".py", ".cu") and p.is_file()]
    for source in sources:
        for kind, name in MARKER.findall(source.read_text()):
            if kind == "quote":
                assert f"[quote {name}]" in quoted, \
                    f"{source.relative_to(REPO)}: [quote {name}] is quoted by no chapter"


@pytest.mark.parametrize("slug", SLUGS)
def test_every_figure_is_made_by_the_chapter_script(slug):
    text = chapter_text(slug)
    figures = [arg for arg, _ in directives(text, "figure")]
    figures += re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    script = CHAPTERS / "figures" / f"ch{slug[:2]}.py"
    for figure in figures:
        assert (CHAPTERS / figure).is_file(), f"{slug}: figure {figure} does not exist"
        stem = Path(figure).stem
        assert script.is_file() and stem in script.read_text(), \
            f"{slug}: no code in {script.relative_to(REPO)} makes {figure}"


def test_the_numbers_a_chapter_prints_are_its_scripts():
    """A figure script may list, under "quoted" in its chNN.json, each number its chapter
    prints, formatted exactly as printed: the chapter's text must hold every one (white
    space aside), so a rerun that changes a number fails here until the prose agrees."""
    checked = 0
    for slug in SLUGS:
        path = CHAPTERS / "figures" / f"ch{slug[:2]}.json"
        quoted = json.loads(path.read_text()).get("quoted") if path.is_file() else None
        if not quoted:
            continue
        text = " ".join(chapter_text(slug).split())
        missing = {key: value for key, value in quoted.items()
                   if " ".join(value.split()) not in text}
        assert not missing, f"{slug}.md does not print these numbers of {path.name}: {missing}"
        checked += 1
    assert checked, "no chapter lists its quoted numbers"


@pytest.mark.parametrize("slug", SLUGS)
def test_links_point_at_real_files(slug):
    for target in re.findall(r"\]\((\.\./[^)#\s]+)", chapter_text(slug)):
        assert (CHAPTERS / target).resolve().exists(), f"{slug}: broken link {target}"
    for lab in re.findall(r"kvlab grade (\w+)", chapter_text(slug)):
        from kvlab.grading import LABS
        assert lab in LABS or lab.isupper(), f"{slug}: no lab named {lab}"


@pytest.mark.parametrize("slug", SLUGS)
def test_the_figure_script_runs(slug, tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("kvlab._kvlab")
    import kvlab
    script = CHAPTERS / "figures" / f"ch{slug[:2]}.py"
    env = {"MPLBACKEND": "Agg", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(Path(kvlab.__file__).parents[1])}
    import os
    env.update({k: v for k, v in os.environ.items()
                if k in ("HOME", "KVLAB_SHARED", "LANG", "KVLAB_CACHE", "XDG_CACHE_HOME",
                         "KVLAB_SMOLLM2_GGUF")})
    # --quick: each script's short run (fewer rounds, shorter texts), to show it still works;
    # the numbers the chapter prints come from its full run, in chNN.json
    run = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--quick"],
                         cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    made = {p.name for p in tmp_path.glob("*.png")}
    wanted = {Path(arg).name for arg, _ in directives(chapter_text(slug), "figure")}
    assert wanted <= made, f"{script.name} did not write {sorted(wanted - made)}"


def _json_numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _json_numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _json_numbers(v)


def _prose(text):
    """The chapter without its code: no fenced blocks other than figures (whose captions
    and alt texts are prose), no inline code, no link targets, no arXiv identifiers, no
    heading numbers."""
    def body_if_figure(block):       # a figure's options and caption, without its fences
        if block[0].startswith(block[1] + "{figure}"):
            return block[0].split("\n", 1)[1].rsplit(block[1], 1)[0]
        return ""
    text = re.sub(r"^(`{3,}).*?^\1\s*$", body_if_figure, text, flags=re.M | re.S)
    text = re.sub(r"`[^`]*`", "", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"arXiv:\S+", "", text)                      # paper identifiers
    return re.sub(r"^#+ [\d.]+", "", text, flags=re.M)


def numbers_not_in_the_json(text, json_names):
    """The decimal numbers and percentages of a text's prose that none of the JSON files
    (chapters/figures/NAME) holds at the precision shown."""
    # a number is matched without its sign ("-0.030 %" reads as 0.030), so the JSON's are too
    numbers = [abs(v) for name in json_names
               for v in _json_numbers(json.loads((CHAPTERS / "figures" / name).read_text()))]
    sections = set(re.findall(r"^#+ (\d+\.\d+) ", text, re.M))    # "9.4" names a section
    prose = _prose(text)
    missing = []
    for match in re.finditer(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(e-?\d+)?(\s?%)?(?![\w.]*\d)",
                             prose):
        text, exponent, percent = match[1].replace(",", ""), match[2], match[3]
        if ("." not in text and not percent) or text in sections:
            continue                      # whole numbers (counts, settings), section numbers
        places = len(text.split(".")[1]) if "." in text else 0
        scales = (1, 100) if percent else UNIT_SCALES
        if exponent:                      # 3.6e-7, written as Python writes 3.6e-07
            text, shown = f"{text}e{int(exponent[1:]):+03d}", f".{places}e"
        else:
            shown = f".{places}f"
        if not any(f"{v * scale:{shown}}" == text for v in numbers for scale in scales):
            missing.append(match[0])
    return missing


@pytest.mark.parametrize("slug", NUMBERS_FROM_JSON)
def test_prose_numbers_come_from_the_json(slug):
    """Every decimal number (1.46x, 0.45 ms) and every percentage in the chapter's prose is a
    number of chNN.json, as the script wrote it, at the precision the prose shows (a
    percentage may be a fraction in the JSON, any number may be shown in another unit,
    UNIT_SCALES): measured numbers are copied, never typed. A number the chapter quotes
    from elsewhere (the course, a paper, a data sheet) is in the JSON too, from the
    script's own table of such facts, with where it comes from."""
    missing = numbers_not_in_the_json(chapter_text(slug), [f"ch{slug[:2]}.json"])
    assert not missing, f"{slug}: numbers in the prose that ch{slug[:2]}.json does not hold: {missing}"


def test_the_course_appendix_numbers_come_from_chapter_1s_json():
    """Appendix B sets the course's own figures against the kit's: both kinds are in
    ch01.json (the course's in its table of facts), so a rerun cannot leave it stale."""
    missing = numbers_not_in_the_json((CHAPTERS / "appendix_course.md").read_text(),
                                      ["ch01.json"])
    assert not missing, f"appendix_course.md: numbers that ch01.json does not hold: {missing}"


def test_numbers_one_chapter_copies_from_another_are_current():
    """Chapter 9 quotes chapter 7's ridge point and read bandwidth; ch09.py copies them
    from ch07.json when it runs. Rerunning ch07.py alone must not leave chapter 9 quoting
    the older figures (rerun ch09.py, or copy the block again)."""
    ch07 = json.loads((CHAPTERS / "figures" / "ch07.json").read_text())
    ch09 = json.loads((CHAPTERS / "figures" / "ch09.json").read_text())
    assert ch09["ridge_from_ch07"] == {
        "cpu_flops_per_byte": ch07["intensity_flops_per_byte"]["cpu_ridge"],
        "cpu_read_gb_per_s": ch07["cpu"]["read_bytes_per_s"] / 1e9,
        "cpu_threads": ch07["setup"]["kvlab_threads"],
        "h200_flops_per_byte": ch07["intensity_flops_per_byte"]["h200_ridge"]}


def test_every_arxiv_paper_a_chapter_cites_is_in_the_references():
    listed = set(re.findall(r"arXiv:(\d{4}\.\d{4,5})", (CHAPTERS / "references.md").read_text()))
    cited = {number for slug in SLUGS
             for number in re.findall(r"arXiv:(\d{4}\.\d{4,5})", chapter_text(slug))}
    assert cited and cited <= listed, f"cited but not in references.md: {sorted(cited - listed)}"
    for number in listed:   # each listed with its link
        assert f"(https://arxiv.org/abs/{number})" in (CHAPTERS / "references.md").read_text()


# Each entry of references.md is a list item that opens with its MyST target, on a line of
# its own: "- (ref-NAME)=", then the entry. A chapter cites it as [text](references.md#ref-NAME).
REFERENCE_LABEL = re.compile(r"^- \((ref-[a-z0-9-]+)\)=$", re.M)
# Entries that only chapter 5 draws on (batching and scheduling): chapters 1 and 5 do not
# link their sources to references.md yet.
def reference_labels():
    text = (CHAPTERS / "references.md").read_text()
    labels = REFERENCE_LABEL.findall(text)
    entries = re.findall(r"^- ", text, re.M)
    assert labels and len(labels) == len(entries), \
        "every entry of references.md must open with its label, '- (ref-NAME)=' on a line of its own"
    assert len(set(labels)) == len(labels), f"labels used twice in references.md: {labels}"
    return set(labels)


def cited_labels(slug):
    return set(re.findall(r"references\.md#([\w-]+)", chapter_text(slug)))


@pytest.mark.parametrize("slug", SLUGS)
def test_every_citation_points_at_an_entry_of_the_references(slug):
    missing = cited_labels(slug) - reference_labels()
    assert not missing, f"{slug} cites labels that references.md does not have: {sorted(missing)}"


def test_every_entry_of_the_references_is_cited():
    """An entry no chapter cites is either a source the prose no longer uses or a fact the
    prose states without its citation."""
    labels = reference_labels()
    cited = set().union(*(cited_labels(slug) for slug in SLUGS))
    uncited = labels - cited
    assert not uncited, f"entries of references.md that no chapter cites: {sorted(uncited)}"


OBJECTIVES = re.compile(r"^After this chapter you can:\n\n((?:- .+\n(?:  .+\n)*)+)", re.M)


@pytest.mark.parametrize("slug", SLUGS)
def test_each_chapter_opens_with_objectives_and_its_key_idea(slug):
    """Before its first section a chapter says what a reader will be able to do (3 to 5
    objectives, "After this chapter you can:" and a list) and states its key idea in a
    paragraph that opens "**The key idea.**"."""
    text = chapter_text(slug)
    opening = text.split("\n## ", 1)[0]
    found = OBJECTIVES.search(opening)
    assert found, f"{slug}: no 'After this chapter you can:' list before the first section"
    items = re.findall(r"^- ", found[1], re.M)
    assert 3 <= len(items) <= 5, f"{slug}: {len(items)} objectives; a chapter states 3 to 5"
    assert re.search(r"^\*\*The key idea\.\*\* \S", opening, re.M), \
        f"{slug}: no '**The key idea.**' paragraph before the first section"


# the sections that may follow a chapter's summary: pointers, not new material
AFTER_SUMMARY = {"In the notebook", "Check yourself", "Lab", "The lab", "Labs", "Sources"}


@pytest.mark.parametrize("slug", SLUGS)
def test_each_chapter_closes_with_a_summary(slug):
    headings = re.findall(r"^## (?:[\d.]+ )?(.+?)\s*$", chapter_text(slug), re.M)
    assert "Summary" in headings, f"{slug}: no '## Summary' section"
    after = headings[headings.index("Summary") + 1:]
    assert set(after) <= AFTER_SUMMARY, \
        f"{slug}: new material after the summary: {sorted(set(after) - AFTER_SUMMARY)}"


APPENDICES = ["appendix_measuring", "appendix_course"]


@pytest.mark.parametrize("name", APPENDICES)
def test_the_appendices_exist_and_are_linked(name):
    assert (CHAPTERS / f"{name}.md").is_file()
    linking = [slug for slug in SLUGS if f"({name}.md" in chapter_text(slug)]
    assert linking, f"no chapter links {name}.md"
