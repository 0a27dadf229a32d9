"""benchmarks/bench_policies.py: its NumPy model of attention sinks is the kit's
AttentionSinks when it rotates as the kit does, and a --quick run writes every section."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvlab
from kvlab.cache_policy import AttentionSinks

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_policies  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return kvlab.load()


def test_numpy_sinks_with_the_kits_rotation_are_the_kits_sinks(model):
    ids = np.arange(150) * 7 % model.config.vocab_size
    policy = AttentionSinks(4, 12)
    want = policy.forward(model, ids, policy.new_cache(model), all_logits=True)
    got = bench_policies.sinks_reference(model, ids, 4, 12, rerotate=False, chunk=64)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # StreamingLLM's numbering changes nothing until the cache first drops a row
    rerotated = bench_policies.sinks_reference(model, ids, 4, 12, rerotate=True, chunk=64)
    np.testing.assert_array_equal(rerotated[:16], got[:16])
    assert np.abs(rerotated[16:] - got[16:]).max() > 1e-3


def test_quick_run_writes_every_section(tmp_path):
    out = tmp_path / "policies.json"
    run = subprocess.run([sys.executable, str(BENCHMARKS / "bench_policies.py"), "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    memory = {(r["policy"], r["generated"]): r for r in result["memory"]}
    assert memory[("window", 256)]["cache_nbytes"] == memory[("window", 64)]["cache_nbytes"]
    assert memory[("full", 256)]["cache_nbytes"] > memory[("full", 64)]["cache_nbytes"]
    assert {r["policy"] for r in result["decode_times"]} == {"full", *bench_policies.POLICIES}
    if result["past_context"] is not None:        # needs the held-out text in ../shared
        assert result["past_context"]["numpy_sinks_vs_kit_max_abs_logit_difference"] < 1e-3
        assert result["accuracy"]
