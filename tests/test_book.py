"""The chapters built as a website (chapters/conf.py: Sphinx, myst-parser, sphinx-book-theme),
as the README tells a reader to build them, and looked at in a browser.

The build must be clean (-W: a warning is an error, and -n: every cross-reference must
resolve, every quoted file and marker must be found). Every link between the built pages
must land on a page and an anchor that exist. Then headless Chromium opens each chapter, as
a reader would, and checks what a reader sees: the chapter's title, every figure drawn at
its size, and every piece of quoted code shown under its caption with the source's text. A
screenshot of each chapter's first screen is kept (KVLAB_BOOK_SHOTS names the folder) for a
person to look at.

Without Sphinx these tests skip, and without Chromium and its driver the browser test skips;
CI installs both and sets KVLAB_TEST_REQUIRE_BOOK=1, which turns those skips into failures."""
import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from chapter_files import CHAPTERS, SLUGS, chapter_text, directives

REQUIRED = os.environ.get("KVLAB_TEST_REQUIRE_BOOK") == "1"


def need(condition, why):
    if not condition:
        if REQUIRED:
            pytest.fail(f"KVLAB_TEST_REQUIRE_BOOK=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built website's folder (built once for this module)."""
    try:
        import myst_parser  # noqa: F401
        import sphinx  # noqa: F401
        import sphinx_book_theme  # noqa: F401
    except ImportError as error:
        need(False, f"the docs tools are not installed ({error.name}): pip install '.[docs]'")
    out = tmp_path_factory.mktemp("book") / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
         str(CHAPTERS), str(out)],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, "the book does not build cleanly:\n" + build.stderr[-6000:]
    return out


def pages(site):
    return sorted(site.glob("*.html"))


def test_every_chapter_and_appendix_is_a_page_in_the_table_of_contents(site):
    index = (site / "index.html").read_text()
    sources = sorted(p.stem for p in CHAPTERS.glob("*.md"))
    for stem in sources:
        assert (site / f"{stem}.html").is_file(), f"{stem}.md was not built"
        if stem != "index":
            assert f'href="{stem}.html"' in index, f"{stem} is not in the table of contents"


HREF = re.compile(r'(?:href|src)="([^"]+)"')


def test_every_link_between_pages_lands_on_a_page_and_an_anchor(site):
    broken = []
    for page in pages(site):
        text = page.read_text()
        for target in set(HREF.findall(text)):
            target = html.unescape(target)
            parts = urlsplit(target)
            if parts.scheme or target.startswith("//") or target.startswith("mailto:"):
                continue
            path = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if not path.exists():
                broken.append(f"{page.name}: {target} (no file)")
                continue
            if parts.fragment and path.suffix == ".html":
                ids = set(re.findall(r'\bid="([^"]+)"', path.read_text()))
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{page.name}: {target} (no anchor)")
    assert not broken, "links that land nowhere:\n" + "\n".join(sorted(broken))


def test_nothing_is_fetched_from_the_internet_to_show_a_page(site):
    """The book reads offline: no script, style sheet or font from another site."""
    outside = re.compile(r'<(?:script|link|img)\b[^>]*(?:src|href)="(?:https?:)?//[^"]*"', re.I)
    for page in pages(site):
        found = [tag for tag in outside.findall(page.read_text())
                 if 'rel="' not in tag or re.search(r'rel="(?:stylesheet|preload|icon)', tag)]
        assert not found, f"{page.name} loads from the internet: {found[:3]}"


def test_the_notebooks_a_chapter_links_are_in_the_book(site):
    for slug in SLUGS:
        text = (site / f"{slug}.html").read_text()
        assert re.search(rf'href="_downloads/[0-9a-f]+/{slug}\.ipynb"', text), \
            f"{slug}.html does not link its notebook"


def quoted_code(slug):
    """(caption, the source's text between its markers) for each quote of a chapter."""
    quotes = []
    for path, options in directives(chapter_text(slug), "literalinclude"):
        source = (CHAPTERS / path).read_text()
        start, end = options["start-after"], options["end-before"]
        body = source[source.index(start) + len(start):source.index(end)]
        body = body.split("\n", 1)[1] if "\n" in body else body    # after the marker's line
        body = body.rsplit("\n", 1)[0]                             # before the end marker's line
        quotes.append((options["caption"], body))
    return quotes


def browser():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        need(False, "selenium is not installed")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") \
        or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    need(chromium and driver, "headless Chromium and chromedriver are not installed "
                              "(Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture(scope="module")
def chromium():
    driver = browser()
    yield driver
    driver.quit()


# What the browser reports about a page: its title, its figures (loaded? drawn how big?)
# and its quoted code blocks (caption and text).
LOOK = """
const main = document.querySelector('main') || document.body;
return {
  title: document.title,
  h1: (main.querySelector('h1') || {}).innerText || '',
  figures: Array.from(main.querySelectorAll('figure img, img')).map(i => ({
      src: i.getAttribute('src'), loaded: i.complete && i.naturalWidth > 0,
      width: i.getBoundingClientRect().width, height: i.getBoundingClientRect().height})),
  quotes: Array.from(main.querySelectorAll('div.literal-block-wrapper')).map(q => ({
      caption: (q.querySelector('.caption-text') || {}).innerText || '',
      code: (q.querySelector('pre') || {}).textContent || '',
      height: q.getBoundingClientRect().height})),
};
"""


def squeeze(text):
    """White space aside, and typographic quotes as typed (Sphinx curls a caption's quotes)."""
    text = text.translate(str.maketrans("\u2018\u2019\u201c\u201d", "''\"\""))
    return " ".join(text.split())


@pytest.mark.parametrize("slug", SLUGS)
def test_a_reader_sees_the_title_the_figures_and_the_quoted_code(slug, site, chromium, tmp_path):
    chromium.get((site / f"{slug}.html").as_uri())
    seen = chromium.execute_script(LOOK)
    title = re.search(r"^# (.+)$", chapter_text(slug), re.M)[1].strip()
    assert squeeze(seen["h1"]).rstrip("#").strip() == title, seen["h1"]
    assert seen["title"].startswith(title), seen["title"]

    wanted = [Path(arg).name for arg, _ in directives(chapter_text(slug), "figure")]
    drawn = {Path(f["src"]).name: f for f in seen["figures"] if f["src"]}
    for name in wanted:
        figure = drawn.get(name)
        assert figure, f"{slug}: figure {name} is not on the page"
        assert figure["loaded"], f"{slug}: figure {name} did not load"
        assert figure["width"] > 200 and figure["height"] > 100, \
            f"{slug}: figure {name} is drawn {figure['width']:.0f}x{figure['height']:.0f} px"

    quotes = quoted_code(slug)
    assert len(seen["quotes"]) == len(quotes), \
        f"{slug}: {len(seen['quotes'])} quoted blocks on the page, {len(quotes)} in the chapter"
    for (caption, body), shown in zip(quotes, seen["quotes"]):
        assert squeeze(shown["caption"]) == squeeze(caption), (shown["caption"], caption)
        assert squeeze(shown["code"]) == squeeze(body), f"{slug}: the quote {caption!r} " \
            "shows other text than its source"
        assert shown["height"] > 20, f"{slug}: the quote {caption!r} is not drawn"

    shots = Path(os.environ.get("KVLAB_BOOK_SHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / f"{slug}.png"
    assert chromium.save_screenshot(str(shot)), "Chromium took no screenshot"
    assert shot.stat().st_size > 20_000, f"{slug}: the screenshot looks blank"
