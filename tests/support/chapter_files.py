"""The chapters' files as the chapter tests read them (tests/test_chapters.py and
tests/test_book.py): where they are, their names, and their MyST directives."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHAPTERS = REPO / "chapters"
SLUGS = ["01_kv_cache", "02_cache_size", "03_gqa", "04_paged", "05_batching",
         "06_quantization", "07_gpu_kernels", "08_fewer_positions", "09_speculative",
         "10_weight_quantization", "11_serving_at_scale"]

DIRECTIVE = re.compile(r"^(`{3,})\{(?P<name>[\w-]+)\}\s*(?P<arg>.*?)\n(?P<body>.*?)^\1\s*$",
                       re.M | re.S)


def directives(text, name):
    """(argument, {option: value}) for each ```{name} block in a MyST file."""
    found = []
    for match in DIRECTIVE.finditer(text):
        if match["name"] != name:
            continue
        options = dict(re.findall(r"^:([\w-]+):\s*(.*?)\s*$", match["body"], re.M))
        found.append((match["arg"].strip(), options))
    return found


def chapter_text(slug):
    return (CHAPTERS / f"{slug}.md").read_text()
