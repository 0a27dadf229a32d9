"""What several test files share: the Engine's block trace replayed into reference counts.

Not a test file (pytest collects nothing here); pyproject.toml puts this folder on the
tests' path, so they `from block_trace import replay`.
"""


def replay(events, refs=None):
    """Reference counts rebuilt from trace events, as notebook 5 does: into refs (a dict
    block -> count, new if None), which it returns."""
    refs = {} if refs is None else refs
    for event in events:
        if event["event"] in ("allocated", "shared", "copied", "released"):
            refs[event["block"]] = event["refs"]
        elif event["event"] == "freed":
            refs[event["block"]] = 0
    return refs
