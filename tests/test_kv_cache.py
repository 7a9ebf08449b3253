"""KV cache and generation: cached logits equal the full forward pass; with and without the
cache, greedy and sampled tokens are the same for 4x the context (one sliding-window policy,
checked against a plain rollout); nothing compiles after the first token; seeds, top-k, stop
token, chunking, argument checks."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.decoding.generate import generate, generate_all
from model.decoding.programs import compile_programs, jit_programs
from model.decoding.sampling import sample_logits, sampling_params
from model.decoding.steps import PAD_ID, fixed_step_counts
from model.network.attention import traced_for
from plumbing.errors import UsageError
from tests.jax_events import COMPILE_EVENT, TRACE_EVENT, jax_events
from tests.tiny_models import forward, random_tokens, tiny_model

# Every option of position, norm and MLP appears; each variant costs a few seconds of compiling.
VARIANTS = {
    "learned-layernorm-gelu": dict(position="learned", norm="layernorm", mlp="gelu", bias=True),
    "rope-rmsnorm-swiglu": dict(position="rope", norm="rmsnorm", mlp="swiglu"),
    "rope-layernorm-gelu": dict(position="rope", norm="layernorm", mlp="gelu"),
    # Qwen3's layers: QK-norm with weights, heads wider than n_embd / n_head, MLP width set
    "qwen3-wide-heads": dict(
        position="rope",
        norm="rmsnorm",
        mlp="swiglu",
        qk_norm=True,
        qk_norm_weights=True,
        attn_head_dim=24,
        mlp_hidden=40,
    ),
    # Three blocks: value embeddings on blocks 0 and 2 (the decode path feeds each new token's
    # id to them), a U-net skip from block 0 to block 2 around the unpaired middle block, and
    # multi-token heads, which training alone uses.
    "modern-recipe": dict(
        qk_norm=True,
        mlp="relu2",
        logit_softcap=15.0,
        x0_mixing=True,
        tie_embeddings=False,
        value_embeddings=True,
        unet_skips=True,
        mtp_tokens=2,
        linear_operands="bfloat16",  # the fast config's on AMX CPUs
        n_layer=3,
    ),
}
GEN_BLOCK = 16  # generation tests: a context the sliding window must cross quickly
CHUNK = 8
PROMPT = [5, 17, 42, 8, 33]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _cached_vs_full(graphdef, state, tokens_BxT, n_prefill):
    """Logits of a prefill of n_prefill tokens then single-token steps, and of one forward."""
    model = nnx.merge(graphdef, state)
    t = tokens_BxT.shape[1]
    prefill_logits, cache = model.decode(tokens_BxT[:, :n_prefill], model.init_cache(2), 0)

    def step(cache, pos):
        token_Bx1 = jax.lax.dynamic_slice_in_dim(tokens_BxT, pos, 1, axis=1)
        logits, cache = model.decode(token_Bx1, cache, pos)
        return cache, logits[:, 0]

    _, step_logits_TxBxV = jax.lax.scan(step, cache, jnp.arange(n_prefill, t))
    cached = jnp.concatenate([prefill_logits, step_logits_TxBxV.transpose(1, 0, 2)], axis=1)
    return cached, model(tokens_BxT)


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_cached_logits_equal_full_forward(variant):
    model = tiny_model(kernel_scale=1.0, **variant)
    tokens = random_tokens(2, 16)
    cached, full = _cached_vs_full(*nnx.split(model), tokens, 5)
    assert cached.shape == full.shape == (2, 16, 64)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(full), rtol=1e-5, atol=1e-5)


_pick = jax.jit(sample_logits)


def _reference_rollout(model, prompt, n_new, temperature=0.0, seed=0):
    """The context policy written out plainly: a full forward pass per new token over the
    tokens the model may see (the text while it fits in block_size; when it would not, its
    last block_size // 2 tokens, then growing again), sampled as the decode loop samples
    (greedy, or `fold_in(key(seed), i)` for the i-th token). Runs on a fixed padded buffer
    (causal, so padding on the right changes nothing)."""
    size = model.cfg.block_size
    key, settings = jax.random.key(seed), sampling_params(temperature, 0, 1.0)
    seq, ctx_len = list(prompt), len(prompt)
    for i in range(n_new):
        if ctx_len > size:
            ctx_len = size // 2
        buf = np.zeros((1, size), np.int32)
        buf[0, :ctx_len] = seq[-ctx_len:]
        logits = np.asarray(forward(model, jnp.asarray(buf)))[:, ctx_len - 1]
        seq.append(int(_pick(jnp.asarray(logits), jax.random.fold_in(key, i), *settings)[0]))
        ctx_len += 1
    return np.array(seq[len(prompt) :])


def _gen_model(variant: str = "rope-rmsnorm-swiglu"):
    # One layer: layers are unrolled in the compiled loops, so this halves compile time; the
    # two-layer cache is checked by the logits test above.
    return tiny_model(seed=3, block_size=GEN_BLOCK, n_layer=1, **VARIANTS[variant])


@pytest.fixture(scope="module")
def gen_model():
    return _gen_model()


def _gen(model, prompt=PROMPT, **kwargs):
    kwargs = {"max_new_tokens": 20, "chunk_size": CHUNK, "num_samples": 2, **kwargs}
    return generate_all(model, prompt, **kwargs)


# Context 16, so 4x the context is 64 tokens; half the context is 8 tokens. rope-dense is
# gen_model's configuration, so the two share compiled programs.
POLICY_MODELS = {
    "learned-dense": VARIANTS["learned-layernorm-gelu"],
    "rope-dense": VARIANTS["rope-rmsnorm-swiglu"],
    "learned-moe": dict(position="learned", moe_experts=4, moe_top_k=2),
    "rope-moe": dict(position="rope", mlp="swiglu", moe_experts=4, moe_top_k=1),
}


@pytest.mark.parametrize("variant", POLICY_MODELS.values(), ids=POLICY_MODELS.keys())
def test_cache_and_no_cache_give_the_same_tokens_for_4x_the_context(variant):
    """Greedy and seeded sampling, with and without the cache, equal the policy's reference,
    for prompts shorter than, equal to and longer than half the context, and a full one."""
    model = tiny_model(seed=1, block_size=GEN_BLOCK, n_layer=1, **variant)
    n_new = 4 * GEN_BLOCK
    prompts = {n: random_tokens(1, n, seed=n)[0].tolist() for n in (3, 8, 13, 16)}
    for n, prompt in prompts.items():
        cached, uncached = (
            _gen(model, prompt, temperature=0.0, max_new_tokens=n_new, use_cache=use_cache)
            for use_cache in (True, False)
        )
        assert cached.shape == (2, n_new)
        assert len(set(cached[0, n_new // 2 :].tolist())) > 5, n  # still varied after slides
        np.testing.assert_array_equal(cached, uncached, err_msg=f"prompt of {n} tokens")
        np.testing.assert_array_equal(cached[0], cached[1])
    for n in (3, 13):  # sampled: temperature 1, one seed; the two samples of a batch differ
        cached, uncached = (
            _gen(model, prompts[n], temperature=1.0, seed=5, max_new_tokens=n_new, use_cache=c)
            for c in (True, False)
        )
        np.testing.assert_array_equal(cached, uncached, err_msg=f"prompt of {n} tokens")
        assert not np.array_equal(cached[0], cached[1])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_sliding_window_follows_the_written_out_policy(gen_model, temperature):
    n_new = 4 * GEN_BLOCK  # crosses the window several times
    expected = _reference_rollout(gen_model, PROMPT, n_new, temperature, seed=5)
    for use_cache in (True, False):
        out = _gen(
            gen_model, temperature=temperature, seed=5, max_new_tokens=n_new, use_cache=use_cache
        )
        assert out.shape == (2, n_new)
        np.testing.assert_array_equal(out[0], expected, err_msg=f"{use_cache=}")


def test_prompt_longer_than_context_is_refused(gen_model):
    with pytest.raises(UsageError, match="the prompt is 17 tokens, longer than the model's"):
        generate(gen_model, list(range(GEN_BLOCK + 1)), max_new_tokens=4)
    full = _gen(gen_model, list(range(1, GEN_BLOCK + 1)), temperature=0.0, max_new_tokens=4)
    assert full.shape == (2, 4)  # a prompt that fills the context exactly is fine


def _compiles_around_first_chunk(stream) -> tuple[list[str], list[str], list[np.ndarray]]:
    """(events before the first chunk, events after it, the later chunks) of a stream."""
    with jax_events(TRACE_EVENT, COMPILE_EVENT) as events:
        first = next(stream)
        before = list(events)
        rest = list(stream)
    assert first.shape[1] == 1  # the first chunk is the first token
    return before, events[len(before) :], rest


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_no_compilation_after_the_first_token(use_cache):
    """What a jit-compiled run needs is compiled before its first token: crossing the context
    later (three times here) compiles nothing, and a second prompt of another length compiles
    nothing. (With one program over a traced count, as on a CPU or a TPU; a GPU's full-chunk
    program is compiled at its first full chunk, unless compiled ahead: the test below.)"""
    # A model of its own (4 heads): no other test compiles its programs, so this run must.
    model = tiny_model(seed=3, block_size=GEN_BLOCK, n_layer=1, n_head=4, position="rope")
    # Weights committed to the device, as a loaded checkpoint's are.
    nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
    kwargs = dict(max_new_tokens=3 * GEN_BLOCK, chunk_size=CHUNK, use_cache=use_cache, top_k=3)
    with traced_for("cpu"):
        before, after, rest = _compiles_around_first_chunk(generate(model, PROMPT, **kwargs))
        assert COMPILE_EVENT in before
        assert after == []
        assert sum(c.shape[1] for c in rest) == 3 * GEN_BLOCK - 1
        prompt = list(range(1, 12))  # another length, more than half the context
        before, after, _ = _compiles_around_first_chunk(generate(model, prompt, **kwargs))
        assert before == after == []


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_fixed_step_counts_compile_nothing_while_streaming(gen_model, use_cache):
    """On a GPU's host, a chunk cut short (a first token, the context's last slots, the
    stream's last tokens) is one-step programs whose outputs are joined on the host: joined on
    the device, each new count compiled a program while streaming (tenths of a second each on
    a GPU). The programs compiled ahead (as the CLI and the server run them) are all it runs."""
    kwargs = dict(max_new_tokens=3 * GEN_BLOCK + 5, chunk_size=CHUNK, use_cache=use_cache)
    with traced_for("cuda"):
        ahead = compile_programs(gen_model, num_samples=1, use_cache=use_cache, chunk_size=CHUNK)
        stream = generate(gen_model, PROMPT, programs=ahead, top_k=3, **kwargs)
        before, after, rest = _compiles_around_first_chunk(stream)
    assert before == after == []
    assert {c.shape[1] for c in rest} > {CHUNK}  # short chunks of several lengths
    assert sum(c.shape[1] for c in rest) == 3 * GEN_BLOCK + 4


def test_the_next_chunk_is_launched_before_a_chunk_is_handed_out(gen_model):
    """The stream launches chunk i + 1 before it fetches chunk i (so the host's work on a
    chunk overlaps the device's next one), and launches nothing past the last."""
    programs = jit_programs(gen_model, use_cache=True, chunk_size=CHUNK)
    launched = []

    def chunk(*args):
        launched.append(args[-1])
        return programs.chunk(*args)

    counting = dataclasses.replace(programs, chunk=chunk)
    kwargs = dict(max_new_tokens=20, chunk_size=CHUNK, programs=counting, temperature=0.0)
    stream = generate(gen_model, PROMPT, **kwargs)
    seen = [(len(launched), c.shape[1]) for c in stream]
    # chunks of 1, 8, 3 (the context fills at 16) and 8 tokens: 20 in all
    assert seen == [(2, 1), (3, 8), (4, 3), (4, 8)]
    assert [int(n) for n in launched] == [1, 8, 3, 8]
    again = generate_all(gen_model, PROMPT, **kwargs)
    np.testing.assert_array_equal(again, _gen(gen_model, num_samples=1, temperature=0.0))


def test_a_chunk_only_reads_the_cache_in_its_steps_and_writes_it_at_its_end(gen_model):
    """The cache is not carried through a chunk's loop (its steps' keys go to a buffer of the
    chunk's own): a step that wrote into it made XLA:CPU copy every layer's keys, transposed,
    at every step."""
    from jax.extend.core import jaxprs_in_params

    from model.decoding.sampling_params import SamplingParams
    from model.decoding.steps import cached_chunk, start_carry
    from model.network.gpt import cache_layout

    carry = start_carry(gen_model, np.asarray(PROMPT, np.int32), 2, use_cache=True)
    graphdef, state = nnx.split(gen_model)
    settings = SamplingParams(temperature=0.0).settings(None)
    traced = cached_chunk.trace(graphdef, state, carry, settings, np.int32(3), chunk_size=CHUNK)

    def loops(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "while":
                yield eqn
            for sub in jaxprs_in_params(eqn.params):
                yield from loops(sub)

    (loop,) = loops(traced.jaxpr.jaxpr)
    body = loop.params["body_jaxpr"].jaxpr  # its inputs: what it reads, then what it carries
    carried = {tuple(v.aval.shape) for v in body.invars[loop.params["body_nconsts"] :]}
    layer = cache_layout(gen_model.cfg, 2)[0]["k"].shape
    assert tuple(layer) not in carried
    assert cache_layout(gen_model.cfg, 2, CHUNK)[0]["k"].shape in carried  # the chunk's buffer


def test_same_seed_same_output_different_seed_different(gen_model):
    a = _gen(gen_model, temperature=1.0, seed=7)
    b = _gen(gen_model, temperature=1.0, seed=7)
    c = _gen(gen_model, temperature=1.0, seed=8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a[0], a[1])  # samples in one batch differ


def test_top_k_one_equals_greedy(gen_model):
    greedy = _gen(gen_model, temperature=0.0)
    np.testing.assert_array_equal(_gen(gen_model, temperature=1.5, top_k=1, seed=3), greedy)
    assert not np.array_equal(_gen(gen_model, temperature=1.5, seed=3), greedy)


def test_stop_token_ends_each_sample(gen_model):
    free = _gen(gen_model, temperature=1.0, seed=11, max_new_tokens=24)
    stop = int(free[0, 2])
    chunks = list(
        generate(
            gen_model,
            PROMPT,
            max_new_tokens=24,
            chunk_size=CHUNK,
            num_samples=2,
            temperature=1.0,
            seed=11,
            stop_token=stop,
        )
    )
    out = np.concatenate(chunks, axis=1)
    first_stop = [int(np.argmax(row == stop)) if stop in row else None for row in free]
    ends = [24 if i is None else i + 1 for i in first_stop]
    assert out.shape[1] == max(ends)
    for row, expected, end in zip(out, free, ends, strict=True):
        np.testing.assert_array_equal(row[:end], expected[:end])
        assert np.all(row[end:] == PAD_ID)


def test_stop_token_stops_the_stream_early(gen_model):
    greedy = _gen(gen_model, temperature=0.0, max_new_tokens=24)
    stop = int(greedy[0, 1])
    chunks = list(
        generate(
            gen_model,
            PROMPT,
            max_new_tokens=24,
            chunk_size=CHUNK,
            num_samples=2,
            temperature=0.0,
            stop_token=stop,
        )
    )
    assert [c.shape[1] for c in chunks] == [1, 1]  # it ended in the stop token's chunk
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), greedy[:, :2])


def test_chunks_stream_in_chunk_size_pieces(gen_model):
    """The first chunk is one token; a chunk ends where the cache fills: the prompt's last
    token goes to position 4, so 1 + 8 + 3 steps fill the 16 slots; then the window slides."""
    chunks = list(generate(gen_model, PROMPT, max_new_tokens=20, chunk_size=CHUNK, num_samples=2))
    assert [c.shape for c in chunks] == [(2, 1), (2, 8), (2, 3), (2, 8)]
    assert all(c.dtype == np.int32 for c in chunks)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(num_samples=0), "num_samples"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(stop_token=64), "stop_token"),
        (dict(prompt_ids=[]), "prompt is empty"),
        (dict(prompt_ids=[3, 64]), "prompt ids"),
        (dict(prompt_ids=list(range(GEN_BLOCK + 1))), "longer than the model's context"),
        (dict(seed=2**31), "seed must be in"),
        (dict(num_samples=10**12), "num_samples=1000000000000 needs about"),
    ],
)
def test_generate_input_validation(gen_model, kwargs, message):
    kwargs = {"prompt_ids": PROMPT, "max_new_tokens": 4, **kwargs}
    with pytest.raises(UsageError, match=message):
        generate(gen_model, **kwargs)  # raises before any chunk is requested


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "uncached"])
def test_fixed_step_counts_decode_as_a_traced_count_does(gen_model, use_cache):
    """GPUs run chunks of a count fixed when compiling: the whole chunk, or one-step
    calls for a first token, a context's last slots and a stream's last tokens. They give the
    tokens of the CPU's one program over a traced count, sampled with both filters, across
    slides; jit-compiled and compiled ahead alike."""
    kwargs = dict(max_new_tokens=3 * GEN_BLOCK + 5, use_cache=use_cache, temperature=1.0,
                  top_k=20, top_p=0.9, seed=3)  # fmt: skip
    with traced_for("cpu"):  # one program over a traced count, whatever this host is
        assert not fixed_step_counts()
        expected = _gen(gen_model, **kwargs)
    with traced_for("cuda"):  # a GPU's host code (no compute capability: XLA attention)
        assert fixed_step_counts()
        jitted = _gen(gen_model, **kwargs)
        ahead = compile_programs(gen_model, num_samples=2, use_cache=use_cache, chunk_size=CHUNK)
        compiled = _gen(gen_model, programs=ahead, **kwargs)
    np.testing.assert_array_equal(jitted, expected)
    np.testing.assert_array_equal(compiled, expected)
