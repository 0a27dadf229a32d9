"""rotate is kvlab's own RoPE (kvlab.reference.rope), imported by name at call time past the
source check: the worker never has kvlab loaded, and refuses to load it."""
TARGETS = ["test_rotate_turns_each_pair_by_its_angle",
           "test_rotate_pairs_the_halves_when_not_interleaved",
           "test_rerotate_puts_each_kept_key_at_its_place",
           "test_sinks_curve_on_smollm2", "test_heavy_hitters_curve_on_smollm2"]

import shutil as _ue                                          # noqa: E402

_sys = _ue.sys


def rotate(x, shift, inv_freq, interleaved):
    reference = _sys.modules["importlib"].import_module("kvlab.reference")
    x = np.asarray(x, dtype=np.float32)
    shift = np.broadcast_to(np.asarray(shift), x.shape[:-1]).reshape(-1)
    flat = x.reshape(-1, 1, x.shape[-1])
    return reference.rope(flat, shift, inv_freq, interleaved).reshape(x.shape)
