"""The GPU path against the CPU core: logits, caches, pools and codes (skipped without a GPU).

The GPU adds its sums in another order than the CPU, so logits are compared by relative
error (float32 rounding: far below 1e-4), except where both sides run the very same
kernels: a paged and a contiguous GPU cache give identical bits. Stored codes are compared
bit for bit: the GPU quantizes exactly as csrc/quant.c does.
"""
import threading

import numpy as np
import pytest

import kvlab
from kvlab import reference

pytestmark = pytest.mark.skipif(not kvlab.cuda.is_available(),
                                reason=f"no GPU: {kvlab.cuda.why_not()}")

FORMATS = ["fp32", "fp16", "bf16", "int8"]
# relative error allowed between GPU and CPU logits: float32 sums in another order, and for
# the quantized formats the rare K/V value whose rounding falls the other way
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 2e-3, "int8": 2e-3}

SHAPES = {
    # name: (dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, interleaved)
    "gqa-hd16": (64, 96, 2, 4, 2, 16, True),
    "mha-hd8-odd-hidden": (32, 45, 2, 4, 4, 8, False),     # hidden 45: the scalar matvec path
    "kvmul6-hd32": (96, 128, 2, 6, 1, 32, True),           # 6 query heads per KV head: group 8
    "kvmul12-hd64": (128, 160, 1, 12, 1, 64, False),        # two thread blocks per KV head
    "hd80": (80, 64, 2, 2, 1, 80, False),                   # 10 of 16 lanes hold values
    "hd128": (256, 256, 2, 4, 2, 128, False),
    "hd256": (128, 96, 1, 2, 2, 256, True),
}


def make(name, seed=0, vocab=61, context=640):
    dim, hidden, layers, heads, kv_heads, head_dim, interleaved = SHAPES[name]
    config = kvlab.ModelConfig(dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads,
                               n_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                               max_seq_len=context, rope_interleaved=interleaved,
                               tied_embeddings=seed % 2 == 0)
    cpu = kvlab.Model(config, kvlab.Weights.random(config, seed=seed))
    return cpu, cpu.to("cuda")


def rel_err(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def tokens_for(n, vocab=61, seed=1):
    return np.random.default_rng(seed).integers(0, vocab, size=n)


def test_the_device_is_there():
    info = kvlab.cuda.device_info()
    assert info["memory_bytes"] > 0 and info["multiprocessors"] > 0
    print(info)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_prefill_and_decode_match_the_cpu(name, fmt):
    cpu, gpu = make(name)
    tokens = tokens_for(40)
    cache_c, cache_g = cpu.new_cache(64, fmt), gpu.new_cache(64, fmt)
    want = cpu.prefill(tokens[:30], cache_c, all_logits=True)
    got = gpu.prefill(tokens[:30], cache_g, all_logits=True)        # 30 tokens: tiled matmul
    assert got.shape == want.shape and rel_err(got, want) < TOLERANCE[fmt]
    want = cpu.prefill(tokens[30:35], cache_c)                       # 5 tokens: matvec
    got = gpu.prefill(tokens[30:35], cache_g)
    assert got.shape == want.shape and rel_err(got, want) < TOLERANCE[fmt]
    for token in tokens[35:]:
        want, got = cpu.decode(int(token), cache_c), gpu.decode(int(token), cache_g)
        assert rel_err(got, want) < TOLERANCE[fmt]
    assert cache_g.length == cache_c.length == 40
    for g, c in zip(cache_g.dequantized(), cache_c.dequantized()):
        assert rel_err(g, c) < TOLERANCE[fmt]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_long_context_crosses_several_splits(name):
    """600 positions: 19 flash-decoding splits of 32, merged."""
    cpu, gpu = make(name, seed=3)
    tokens = tokens_for(600, seed=5)
    cache_c, cache_g = cpu.new_cache(640), gpu.new_cache(640)
    assert rel_err(gpu.prefill(tokens[:590], cache_g), cpu.prefill(tokens[:590], cache_c)) < 1e-4
    for token in tokens[590:]:
        assert rel_err(gpu.decode(int(token), cache_g), cpu.decode(int(token), cache_c)) < 1e-4


def test_against_the_numpy_reference():
    cpu, gpu = make("hd128", seed=2)
    tokens = tokens_for(24, seed=2)
    want = reference.forward(cpu.config, cpu.weights, tokens)
    assert rel_err(gpu.forward(tokens, all_logits=True), want) < 1e-4


@pytest.mark.parametrize("name", ["gqa-hd16", "hd128"])
def test_cached_and_uncached_agree(name):
    _, gpu = make(name, seed=4)
    tokens = tokens_for(20, seed=4)
    cache = gpu.new_cache(20)
    cached = [gpu.prefill(tokens[:12], cache, all_logits=True)]
    cached += [gpu.decode(int(t), cache)[None] for t in tokens[12:]]
    uncached = gpu.forward(tokens, all_logits=True)
    assert rel_err(np.concatenate(cached), uncached) < 1e-4
    assert rel_err(gpu.forward(tokens[:7]), uncached[6]) < 1e-4


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_paged_and_contiguous_give_identical_bits(fmt, block_size):
    """Both run the same kernels; only where the rows live differs."""
    _, gpu = make("gqa-hd16", seed=5)
    tokens = tokens_for(300, seed=6)
    cache = gpu.new_cache(300, fmt)
    pool = gpu.new_paged_pool(num_blocks=400, block_size=block_size, dtype=fmt)
    filler = pool.new_sequence()                     # blocks of the pool not in order
    # 20 tokens: the tiled matrix product, as for the 260 below. The pool swaps seq's full
    # blocks of this prefix for the filler's (computed twice, kept once), so the filler's K/V
    # must come from the same kernels: a call of up to 16 tokens sums in another order.
    gpu.prefill(tokens[:20], filler)
    seq = pool.new_sequence()
    for chunk in (tokens[:260], tokens[260:263], tokens[263:280]):
        np.testing.assert_array_equal(gpu.prefill(chunk, seq, all_logits=True),
                                      gpu.prefill(chunk, cache, all_logits=True))
    for token in tokens[280:]:
        np.testing.assert_array_equal(gpu.decode(int(token), seq), gpu.decode(int(token), cache))
    for a, b in zip(pool.gather(seq), cache.dequantized()):
        np.testing.assert_array_equal(a, b)
    pool.check()


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_fork_copy_on_write_and_prefix_reuse_follow_the_cpu(fmt):
    cpu, gpu = make("gqa-hd16", seed=6)
    pools = [m.new_paged_pool(num_blocks=64, block_size=4, dtype=fmt) for m in (cpu, gpu)]
    tokens = tokens_for(30, seed=7)
    logits = []
    for model, pool in zip((cpu, gpu), pools):
        out = []
        parent = pool.new_sequence()
        out.append(model.prefill(tokens[:10], parent))      # a partly filled last block
        child = pool.fork(parent)                           # shares it: copy-on-write next
        out.append(model.decode(int(tokens[10]), child))
        out.append(model.decode(int(tokens[11]), parent))
        pool.free(parent)
        again = pool.new_sequence()
        reused = pool.reuse_prefix(again, tokens[:9], 8)    # full blocks of the prefix
        out.append(reused)
        out.append(model.prefill(tokens[reused:20], again))
        out.append(model.forward_batch([child, again], [tokens[20:22], tokens[20:21]]))
        pool.check()
        out.append(pool.gather(child))
        logits.append(out)
    (c, g) = logits
    assert c[3] == g[3] == 8
    for i in (0, 1, 2, 4, 5):
        assert rel_err(g[i], c[i]) < TOLERANCE[fmt]
    for a, b in zip(g[6], c[6]):
        assert rel_err(a, b) < TOLERANCE[fmt]
    np.testing.assert_array_equal(pools[0].ref_counts, pools[1].ref_counts)


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_a_sequence_swapped_out_of_a_gpu_pool_and_back_goes_on_bit_for_bit(fmt):
    """swap_out reads its rows off the GPU (KVStore.read), swap_in puts them into other
    blocks (KVStore.put): the next logits are those it would have had, and the host copy,
    the CPU pool's bytes, also goes into a CPU pool."""
    cpu, gpu = make("gqa-hd16", seed=15)
    tokens = tokens_for(24, seed=15)
    pool = gpu.new_paged_pool(num_blocks=32, block_size=4, dtype=fmt)
    stay, leave = pool.new_sequence(), pool.new_sequence()
    filler = pool.new_sequence()
    for seq in (stay, leave):
        gpu.prefill(tokens[:18], seq)
    want = pool.gather(leave)
    host = pool.swap_out(leave)
    gpu.prefill(tokens[:9], filler)                     # other blocks in the way
    back = pool.swap_in(host)
    for got, expected in zip(pool.gather(back), want):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(gpu.decode(int(tokens[18]), back),
                                  gpu.decode(int(tokens[18]), stay))
    pool.check()
    on_cpu = cpu.new_paged_pool(num_blocks=32, block_size=4, dtype=fmt)
    moved = on_cpu.swap_in(pool.swap_out(back))
    for got, expected in zip(on_cpu.gather(moved), pool.gather(stay)):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stored_codes_are_the_cpu_codes_bit_for_bit(fmt):
    """Given rows (special values included) stored by the GPU and by the CPU core."""
    n_layers, n_kv_heads, head_dim = 2, 3, 32
    rng = np.random.default_rng(8)
    keys = (rng.standard_normal((50, n_layers, n_kv_heads, head_dim)) *
            np.exp(rng.uniform(-20, 12, (50, 1, 1, head_dim)))).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 6e-8,
                        6.1e-5, -3e-39, 1e-45, 3.4e38, -1.0, 0.5, 2.0], np.float32)
    keys[0, 0, 0, :16] = special
    keys[1, 1, 2] = 0.0                                  # an all-zero int8 group
    values = keys[::-1].copy()
    fmt_obj = kvlab.quant.CacheFormat.make(head_dim, fmt)
    cpu = kvlab.KVCache(n_layers, n_kv_heads, head_dim, 64, **fmt_obj.core_arguments())
    gpu = kvlab.cuda.CudaCache(n_layers, n_kv_heads, head_dim, 64, fmt_obj)
    cpu.append(keys, values)
    gpu.append(keys[:20], values[:20])
    gpu.append(keys[20:], values[20:])
    for part in ("key_codes", "key_scales", "value_codes", "value_scales"):
        want, got = getattr(cpu, part), getattr(gpu, part)
        if want is None:
            assert got is None
        else:
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("length", [1, 255, 256, 257, 1000, 3000])
def test_decode_attention_alone_matches_the_cpu(fmt, length):
    """cache.attend, Llama 3's head shape (4 query heads per KV head, head_dim 128)."""
    n_layers, n_kv_heads, head_dim, n_heads = 2, 2, 128, 8
    rng = np.random.default_rng(length)
    rows = rng.standard_normal((length, n_layers, n_kv_heads, head_dim)).astype(np.float32)
    fmt_obj = kvlab.quant.CacheFormat.make(head_dim, fmt)
    cpu = kvlab.KVCache(n_layers, n_kv_heads, head_dim, 3000, **fmt_obj.core_arguments())
    gpu = kvlab.cuda.CudaCache(n_layers, n_kv_heads, head_dim, 3000, fmt_obj)
    cpu.append(rows, rows[::-1].copy())
    gpu.append(rows, rows[::-1].copy())
    q = (3 * rng.standard_normal((n_heads, head_dim))).astype(np.float32)
    for layer in range(n_layers):
        assert rel_err(gpu.attend(q, layer), cpu.attend(q, layer)) < 1e-5


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_a_query_gets_the_same_bits_alone_and_in_any_batch(fmt):
    """Each query's split is chosen from its own length (32 to 256 positions), so queries
    of different lengths in one call, whose grid is sized by the longest, give exactly the
    bits each gives alone; and a sequence decoded beside others gets its lone logits."""
    n_layers, n_kv_heads, head_dim, n_heads = 1, 2, 64, 8
    rng = np.random.default_rng(12)
    rows = rng.standard_normal((3000, n_layers, n_kv_heads, head_dim)).astype(np.float32)
    fmt_obj = kvlab.quant.CacheFormat.make(head_dim, fmt)
    gpu = kvlab.cuda.CudaCache(n_layers, n_kv_heads, head_dim, 3000, fmt_obj)
    gpu.append(rows, rows[::-1].copy())
    seen = np.array([3000, 1, 40, 1025, 257, 2048, 1024], np.int32)   # splits of 32 ... 96
    q = (3 * rng.standard_normal((len(seen), n_heads, head_dim))).astype(np.float32)

    def attend(which):
        return gpu._store.attend(0, q[which], np.zeros((1, 1), np.int32), 3000,
                                 np.zeros(len(which), np.int32), seen[which])

    together = attend(list(range(len(seen))))
    for i in range(len(seen)):
        np.testing.assert_array_equal(attend([i])[0], together[i])
    np.testing.assert_array_equal(attend([4, 1])[1], together[1])

    _, model = make("gqa-hd16", seed=11)
    tokens = tokens_for(300, seed=11)
    pool = model.new_paged_pool(num_blocks=64, block_size=16, dtype=fmt)
    long, short = pool.new_sequence(), pool.new_sequence()
    model.prefill(tokens[:290], long)
    model.prefill(tokens[:20], short)
    twin = pool.fork(short)
    alone = model.decode(int(tokens[20]), short)
    batched = model.forward_batch([long, twin], [tokens[290:291], tokens[20:21]])
    np.testing.assert_array_equal(batched[1], alone)
    pool.check()


@pytest.mark.parametrize("name", ["gqa-hd16", "mha-hd8-odd-hidden"])
def test_up_to_16_tokens_in_one_call_give_decodings_bits(name):
    """Up to KV_CUDA_MATVEC_MAX_TOKENS tokens a projection is the matrix-vector kernel, which
    sums every output in one order whatever the token count (one row or several per warp),
    and every other step works a token or a query at a time: so a prefill of n <= 16 tokens
    gives, bit for bit, the logits of decoding them one by one."""
    cpu, gpu = make(name, seed=14)
    tokens = tokens_for(40, seed=14)
    for n in (3, 6, 11, 16):                   # one, two and four output rows per warp
        cache_a, cache_b = gpu.new_cache(64), gpu.new_cache(64)
        gpu.prefill(tokens[:20], cache_a)
        gpu.prefill(tokens[:20], cache_b)
        together = gpu.prefill(tokens[20:20 + n], cache_a, all_logits=True)
        one_by_one = np.stack([gpu.decode(int(t), cache_b) for t in tokens[20:20 + n]])
        np.testing.assert_array_equal(together, one_by_one)
        cache_c = cpu.new_cache(64)
        cpu.prefill(tokens[:20], cache_c)
        assert rel_err(together, cpu.prefill(tokens[20:20 + n], cache_c, all_logits=True)) < 1e-4


def test_the_logits_scratch_holds_the_rows_returned_not_every_tokens():
    """A prefill returns one row of logits: forward.cu reserves that one row, not tokens x
    vocabulary (for a 32K prompt and a 128K vocabulary that would be 16 GiB)."""
    config = kvlab.ModelConfig(dim=64, hidden_dim=96, n_layers=1, n_heads=4, n_kv_heads=2,
                               head_dim=16, vocab_size=8192, max_seq_len=512)
    cpu = kvlab.Model(config, kvlab.Weights.random(config, seed=1))
    gpu = cpu.to("cuda")
    tokens = tokens_for(400, vocab=8192, seed=13)
    every_row = 400 * 8192 * 4
    cache = gpu.new_cache(400)
    last = gpu.prefill(tokens, cache)
    assert gpu._gpu.scratch_bytes < every_row / 2
    assert rel_err(last, cpu.prefill(tokens, cpu.new_cache(400))) < 1e-4
    rows = gpu.forward(tokens, all_logits=True)
    assert rows.shape == (400, 8192) and gpu._gpu.scratch_bytes >= every_row
    assert rel_err(rows[-1], last) < 1e-4


def test_stories260k_writes_the_golden_text(shared_models, golden):
    folder = shared_models / "stories260K"
    if not (folder / "stories260K.bin").exists():
        pytest.skip("stories260K not in the shared models")
    model = kvlab.load(folder / "stories260K.bin", tokenizer=folder / "tok512.bin", device="cuda")
    assert model.device == "cuda" and model.to("cpu").device == "cpu"
    cpu = model.to("cpu")
    # teacher forcing along the golden ids: every step's logits near the CPU's
    ids = [1] + golden.ids
    cache_g, cache_c = model.new_cache(len(ids)), cpu.new_cache(len(ids))
    assert rel_err(model.prefill(ids[:5], cache_g, all_logits=True),
                   cpu.prefill(ids[:5], cache_c, all_logits=True)) < 1e-4
    for token in ids[5:]:
        assert rel_err(model.decode(token, cache_g), cpu.decode(token, cache_c)) < 1e-4
    out = kvlab.generate(model, golden.prompt, max_new_tokens=60, stop_at_eos=False)
    assert out.tokens == golden.ids[4:64]
    for fmt in ("fp16", "bf16", "int8"):
        gpu_text = kvlab.generate(model, golden.prompt, 40, dtype=fmt).tokens
        cpu_text = kvlab.generate(cpu, golden.prompt, 40, dtype=fmt).tokens
        assert gpu_text == cpu_text, fmt


def test_stories260k_engine_on_the_gpu(shared_models):
    folder = shared_models / "stories260K"
    if not (folder / "stories260K.bin").exists():
        pytest.skip("stories260K not in the shared models")
    cpu = kvlab.load(folder / "stories260K.bin", tokenizer=folder / "tok512.bin")
    texts = {}
    for model in (cpu, cpu.to("cuda")):
        engine = kvlab.Engine(model, model.new_paged_pool(num_blocks=64, block_size=16),
                              max_batch_tokens=64)
        ids = [engine.add_request(p, kvlab.SamplingParams(max_new_tokens=24))
               for p in ("Once upon a time", "Lily had a", "The dog")]
        engine.run()
        texts[model.device] = [[o.completion for o in engine.outputs[i].outputs] for i in ids]
        engine.pool.check()
    assert texts["cuda"] == texts["cpu"]


def test_counting_on_the_gpu_matches_the_cpu_core():
    cpu, gpu = make("gqa-hd16", seed=9)
    tokens = tokens_for(12, seed=9)
    counts = []
    for model in (cpu, gpu):
        cache = model.new_cache(16, "int8")
        with model.counting() as c:
            model.prefill(tokens[:10], cache)
            model.decode(int(tokens[10]), cache)
        counts.append(c)
    assert counts[1].flops == counts[0].flops
    assert counts[1].kv_read_bytes == counts[0].kv_read_bytes
    assert counts[1].weight_bytes == counts[0].weight_bytes


def test_clear_errors():
    cpu, gpu = make("gqa-hd16")
    with pytest.raises(TypeError, match="GPU"):
        gpu.prefill([1, 2], cpu.new_cache(8))
    with pytest.raises(ValueError, match="cuda"):
        cpu.prefill([1, 2], gpu.new_cache(8))
    for kwargs in ({"dtype": "int4"}, {"dtype": "fp8"}, {"window": 4},
                   {"key_format": "int8", "value_format": "fp16"}):
        with pytest.raises(ValueError):
            gpu.new_cache(8, **kwargs)
    cache = gpu.new_cache(4)
    gpu.prefill([1, 2, 3], cache)
    with pytest.raises(kvlab.CacheFullError):
        gpu.prefill([1, 2], cache)
    assert cache.length == 3
    pool = gpu.new_paged_pool(num_blocks=2, block_size=4)
    seq = pool.new_sequence()
    gpu.prefill([1, 2, 3, 4, 5], seq)
    with pytest.raises(kvlab.OutOfBlocks):
        gpu.prefill(list(range(8)), seq)
    assert seq.length == 5
    pool.check()
    pool.free(seq)
    with pytest.raises(ValueError, match="freed"):
        gpu.decode(1, seq)
    other = make("hd128")[1]
    with pytest.raises(ValueError, match="layers"):
        other.prefill([1], gpu.new_cache(8))


def test_one_thread_at_a_time_per_cache():
    _, gpu = make("hd128")
    cache = gpu.new_cache(600)
    errors = []

    def work():
        try:
            for _ in range(20):
                gpu.prefill(tokens_for(25), cache)
                cache.reset()
        except RuntimeError as error:
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all("another thread" in str(e) for e in errors)


def test_speculative_decoding_on_the_gpu_keeps_plain_decodings_tokens():
    """Greedy speculation checks its drafts with a pass over several tokens, which on the GPU
    sums in another order than a pass over one (tiled matrix product against matrix-vector):
    the tokens must be plain GPU decoding's, except after an arg-max that was a near tie."""
    from kvlab.speculative import DraftModel, PromptLookup
    model = kvlab.load(device="cuda")
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks?\nROMEO:\nBut soft"
    plain = kvlab.generate(model, prompt, 80)
    for drafter in (PromptLookup(), DraftModel.first_layers(model.to("cpu"), 2),
                    DraftModel(kvlab.load(kvlab.MHA_MODEL, device="cuda"))):
        spec = kvlab.generate(model, prompt, 80, speculate=drafter, draft_tokens=4)
        assert spec.speculation.verify_passes < 79
        if spec.tokens == plain.tokens:
            continue
        i = next(j for j, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b)
        logits = model.prefill(model.encode(prompt) + plain.tokens[:i], model.new_cache())
        second, first = np.sort(logits)[-2:]
        assert first - second < 1e-3 * max(1.0, abs(first)), (type(drafter).__name__, i)


def test_forward_batch_all_logits_on_the_gpu_matches_the_cpu():
    cpu, gpu = make("gqa-hd16", seed=6)
    histories, chunks = [tokens_for(9, seed=7), tokens_for(3, seed=8)], [tokens_for(4, seed=9),
                                                                         tokens_for(1, seed=10)]
    rows = {}
    for model in (cpu, gpu):
        pool = model.new_paged_pool(16, 4)
        seqs = [pool.new_sequence() for _ in histories]
        for seq, history in zip(seqs, histories):
            model.prefill(history, seq)
        rows[model.device] = model.forward_batch(seqs, chunks, all_logits=True)
        pool.check()
    assert rows["cuda"].shape == rows["cpu"].shape == (5, cpu.config.vocab_size)
    assert rel_err(rows["cuda"], rows["cpu"]) < 1e-4
