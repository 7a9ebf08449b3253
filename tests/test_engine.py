"""The serving engine in-process, on a tiny random model: prompt and token log-probabilities
against a full forward pass, prefix reuse against a cold row, one failing request that leaves
the engine serving, the stop-string scan, and the one set of sampling checks."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.decoding.generate import generate_all
from model.decoding.programs import compile_programs
from model.decoding.sampling_params import SEED_MAX, SamplingParams
from model.network.attention import traced_for
from model.serving.engine import DEFAULT_STREAM_INTERVAL_S, Engine
from model.serving.inbox import Inbox
from model.serving.requests import EngineStopping, QueueFull, Request
from model.serving.text import StopText
from plumbing.errors import UsageError
from tests.jax_events import COMPILE_EVENT, jax_events
from tests.tiny_models import forward, tiny_model
from tokenizer import CharTokenizer

BLOCK = 64  # refill window 32: prompt pieces of 16 and 32 tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, kernel_scale=1.0, block_size=BLOCK)


@pytest.fixture(scope="module")
def tokenizer():
    chars = "".join(chr(c) for c in range(33, 33 + 63))  # 63 characters + end-of-text = 64
    return CharTokenizer.train(chars, special_tokens=["<|endoftext|>"])


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    engine = Engine(model, tokenizer, rows=4, queue_size=16, chunk_steps=4)
    engine.start()
    yield engine
    engine.stop()


class Collect:
    """A request's events, and a way to wait for its end."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.ended = threading.Event()

    def __call__(self, kind: str, data: object) -> None:
        self.events.append((kind, data))
        if kind in ("done", "error"):
            self.ended.set()

    def of(self, kind: str) -> list:
        return [data for k, data in self.events if k == kind]


def run(engine: Engine, ids, max_tokens: int, **kwargs) -> Collect:
    collect = Collect()
    engine.submit(Request(list(ids), max_tokens, collect, **kwargs))
    assert collect.ended.wait(60), collect.events
    return collect


def direct_logprobs(model, ids) -> np.ndarray:
    """log p(ids[i + 1] | ids[:i + 1]) for every i, from one full forward pass."""
    logits = forward(model, jnp.asarray([ids], jnp.int32))[0]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
    return logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def prompt_of(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 63, n).tolist()


@pytest.mark.parametrize("n", [2, 9, 33, 50, BLOCK])  # one piece, two pieces, the whole context
def test_echo_scores_the_prompt_as_a_full_forward_pass(engine, model, n):
    ids = prompt_of(n, n)
    got = run(engine, ids, 0, logprobs=5, echo=True)
    (scores,) = got.of("prompt")
    np.testing.assert_allclose(scores["logprob"], direct_logprobs(model, ids), atol=1e-4)
    # the alternatives are the best five, best first, and the chosen one is among them or below
    assert np.all(np.diff(scores["top_logprobs"], axis=1) <= 1e-6)
    assert np.all(scores["logprob"] <= scores["top_logprobs"][:, 0] + 1e-5)
    assert got.of("done")[0] == {
        "finish_reason": "length",
        "prompt_tokens": n,
        "completion_tokens": 0,
    }


def test_generated_tokens_carry_their_logprobs(engine, model):
    ids = prompt_of(1, 10)
    got = run(engine, ids, 12, logprobs=2, sampling=SamplingParams(temperature=0.0))
    tokens = np.concatenate([t["token"] for t in got.of("tokens")])
    logprobs = np.concatenate([t["logprob"] for t in got.of("tokens")])
    assert len(tokens) == 12
    np.testing.assert_allclose(
        logprobs, direct_logprobs(model, ids + tokens.tolist())[9:], atol=1e-4
    )
    top = np.concatenate([t["top_ids"] for t in got.of("tokens")])
    assert np.all(top[:, 0] == tokens)  # greedy: each token is the most likely one


def test_output_waits_for_the_stream_interval_and_loses_nothing(engine):
    """With every chunk sent, a request gets an event per chunk; with a long interval, its
    first chunk at once and the rest with its end: the same text and the same scores."""
    ids, greedy = prompt_of(1, 10), SamplingParams(temperature=0.0)
    got = {}
    try:
        for interval in (0.0, 60.0):
            engine.stream_interval_s = interval  # read at admission; the engine is idle here
            got[interval] = run(engine, ids, 24, logprobs=2, sampling=greedy)
    finally:
        engine.stream_interval_s = DEFAULT_STREAM_INTERVAL_S
    every, held = got[0.0], got[60.0]
    assert len(every.of("tokens")) >= 6  # a 1-step chunk after admission, then 4-step ones
    assert len(held.of("tokens")) == len(held.of("text")) == 2
    assert [k for k, _ in held.events] == ["tokens", "text", "tokens", "text", "done"]
    assert "".join(held.of("text")) == "".join(every.of("text"))
    for name in ("token", "logprob", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(
            np.concatenate([t[name] for t in held.of("tokens")]),
            np.concatenate([t[name] for t in every.of("tokens")]),
        )
    assert held.of("done") == every.of("done")
    assert held.of("done")[0]["completion_tokens"] == 24


def test_a_shared_prefix_is_reused_and_gives_the_cold_answer(engine, model):
    context = prompt_of(7, 40)
    first = run(engine, [*context, 5, 6], 0, logprobs=1, echo=True)
    before = engine.stats()
    second = run(engine, [*context, 9, 3, 4], 6, logprobs=1, echo=True,
                 sampling=SamplingParams(temperature=0.0))  # fmt: skip
    after = engine.stats()
    assert after["prefix_hits"] == before["prefix_hits"] + 1
    # 40 tokens shared; the last of them runs again (its logits score the first new token)
    assert after["reused_tokens"] - before["reused_tokens"] == 39
    (scores,) = second.of("prompt")
    np.testing.assert_allclose(
        scores["logprob"], direct_logprobs(model, [*context, 9, 3, 4]), atol=1e-4
    )
    # A cold engine gives the same text and scores.
    cold = Engine(model, engine.tokenizer, rows=1, queue_size=2, chunk_steps=4)
    cold.start()
    try:
        again = run(cold, [*context, 9, 3, 4], 6, logprobs=1, echo=True,
                    sampling=SamplingParams(temperature=0.0))  # fmt: skip
    finally:
        cold.stop()
    assert "".join(again.of("text")) == "".join(second.of("text"))
    np.testing.assert_allclose(again.of("prompt")[0]["logprob"], scores["logprob"], atol=1e-5)
    assert first.of("done")


def test_one_failing_request_gets_an_error_and_the_engine_goes_on(engine):
    def explode(kind, data):
        raise RuntimeError("a client callback that fails")

    engine.submit(Request([1, 2, 3], 4, explode))
    time.sleep(0.5)
    assert engine.stats()["status"] == "ok"
    assert run(engine, [1, 2, 3], 4).of("done")


def test_full_queue_and_stopping_are_told_apart():
    model = tiny_model(block_size=16)
    tokenizer = CharTokenizer.train("abc", special_tokens=[])
    engine = Engine(model, tokenizer, rows=1, queue_size=1)  # not started: nothing is taken
    engine.submit(Request([1], 4, Collect()))
    with pytest.raises(QueueFull):
        engine.submit(Request([1], 4, Collect()))
    engine.drain()
    with pytest.raises(EngineStopping):
        engine.submit(Request([1], 4, Collect()))


def test_the_inbox_hands_the_engine_live_requests_and_wakes_it_to_stop():
    inbox = Inbox(queue_size=4)
    requests = [Request([1], 4, Collect()) for _ in range(4)]
    for request in requests:
        inbox.submit(request)
    requests[0].cancelled.set()
    assert inbox.take(2) == requests[1:3]  # oldest first, the gone client skipped
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(inbox.wait_for_work(idle=True)))
    inbox.take(1)  # nothing waits now: an idle engine thread waits
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()
    late = Request([2], 4, Collect())
    inbox.submit(late)
    waiter.join(5)
    assert woke == [True]
    inbox.stop("stopping now")
    inbox.stop("a later reason")
    assert inbox.wait_for_work(idle=True) is False
    assert inbox.close() == ("stopping now", [late])
    with pytest.raises(EngineStopping, match="stopping now"):
        inbox.submit(Request([1], 4, Collect()))


def test_a_chunk_longer_than_the_context_is_refused_in_one_line():
    # serve.chunk_steps=129 on a 128-token model failed in JAX with a traceback
    model = tiny_model(block_size=16)
    with pytest.raises(UsageError, match="chunk_steps must be at most the model's context, 16"):
        Engine(model, CharTokenizer.train("abc", special_tokens=[]), rows=1, queue_size=1,
               chunk_steps=17)  # fmt: skip


def test_a_cancelled_waiting_request_holds_no_place_in_the_queue():
    # clients gone from the queue kept their places: live clients got 429
    engine = Engine(
        tiny_model(block_size=16),
        CharTokenizer.train("abc", special_tokens=[]),
        rows=1,
        queue_size=2,
    )  # fmt: skip  (not started: nothing is taken)
    gone = [Request([1], 4, Collect()) for _ in range(2)]
    for request in gone:
        engine.submit(request)
    assert engine.stats()["queue_length"] == 2
    gone[0].cancelled.set()
    assert engine.stats()["queue_length"] == 1
    engine.submit(Request([1], 4, Collect()))  # takes the gone client's place
    with pytest.raises(QueueFull):
        engine.submit(Request([1], 4, Collect()))


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(top_k=2**31), "top_k must be an integer in 0..2147483647"),
        (SamplingParams(seed=-1), "seed must be in 0..2147483647"),
        (SamplingParams(seed=SEED_MAX + 1), "seed must be in 0..2147483647"),
        (SamplingParams(temperature=float("inf")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
    ],
)
def test_sampling_params_have_one_range_each(params, message):
    with pytest.raises(UsageError, match=message):
        params.checked()


def first_stop(text: str, stops: list[str]) -> str:
    """Reference: the text before the first stop string to be completed (at the same end,
    the one that starts first)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if starts:
            return text[: min(starts)]
    return text


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text("abc", min_size=1, max_size=5), max_size=4),
    st.lists(st.text("abc", max_size=4), max_size=8),
)
def test_stop_text_matches_the_reference_for_any_split(stops, parts):
    text = StopText(stops)
    out = "".join(text.feed(p.encode()) for p in parts) + text.finish()
    assert out == first_stop("".join(parts), stops)


def test_the_stop_scan_is_linear_in_the_text():
    # Four stop strings of 3,000-4,000 characters that the text keeps almost matching: the
    # scan held back and re-checked every candidate end, quadratic in the stop length per
    # token (hours here); one automaton step per character takes well under a second.
    stops = ["x" * 3000 + "y", "x" * 4000 + "z", "x" * 3500 + "w", "x" * 3999 + "v"]
    text = StopText(stops)
    started = time.perf_counter()
    sent = "".join(text.feed(b"xxxxxxxx") for _ in range(2000))
    assert time.perf_counter() - started < 20  # a complexity guard, not a speed target
    assert sent == "x" * (16_000 - 4000) and not text.stopped


@pytest.mark.parametrize("host", ["cpu", "cuda", "tpu"])
def test_rows_of_any_length_decode_as_generate_does_across_buckets_and_slides(tokenizer, host):
    # Rows of different lengths share chunks: each chunk attends over as many cache slots as
    # its longest row needs (32 or 64 here), and every row slides past the context (64). As a
    # GPU's host: chunk programs of fixed step counts (model.decoding.steps); a TPU's: not.
    with traced_for(host):
        prompts = [prompt_of(20, 3), prompt_of(21, 30), prompt_of(22, 50)]
        settings_of = [SamplingParams(temperature=0.0), SamplingParams(0.9, 5, 0.95, 7),
                       SamplingParams(1.1, 0, 0.9, 8)]  # fmt: skip
        # a chaotic model (kernel scale 3): its next token depends on the whole context
        model = tiny_model(seed=5, kernel_scale=3.0, block_size=BLOCK)
        engine = Engine(model, tokenizer, rows=4, queue_size=16, chunk_steps=4)
        engine.start()
        assert engine.programs.fixed_counts == (host == "cuda")
        collects = [Collect() for _ in prompts]
        # serving compiles nothing: start-up compiled every program it runs
        with jax_events(COMPILE_EVENT) as compiled:
            for ids, params, collect in zip(prompts, settings_of, collects, strict=True):
                engine.submit(Request(ids, 90, collect, sampling=params, logprobs=0))
            for collect in collects:
                assert collect.ended.wait(60)
        assert compiled == []
        for ids, params, collect in zip(prompts, settings_of, collects, strict=True):
            got = np.concatenate([t["token"] for t in collect.of("tokens")])
            expected = generate_all(
                model, ids, max_new_tokens=90, temperature=params.temperature,
                top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                stop_token=engine.stop_token,
            )[0]  # fmt: skip
            expected = expected[expected >= 0]
            if expected[-1] == engine.stop_token:  # the engine ends there, without sending it
                expected = expected[:-1]
            np.testing.assert_array_equal(got, expected)
        engine.stop()


def test_a_chunk_leaves_free_rows_caches_as_they_were_and_decodes_busy_rows_alike(model):
    # Free rows run too (at the last slot of the length attended): what they write must not
    # reach their kept prompts, and a busy row decodes as it would alone.
    from flax import nnx

    from model.serving.batch import attended_cache, batch_chunk, batch_settings, empty_batch

    graphdef, state = nnx.split(model)
    batch = empty_batch(model, rows=4)
    noise = jax.random.normal(jax.random.key(0), batch["cache"][0]["k"].shape)
    batch["cache"] = jax.tree.map(lambda x: x + noise, batch["cache"])  # kept prompts
    batch["pos"] = jnp.array([5, 40, 9, 31], jnp.int32)
    before = jax.tree.map(np.asarray, batch)
    settings = jax.tree.map(jnp.asarray, batch_settings(4))
    active = jnp.array([True, False, True, False])
    length = 48
    attended = attended_cache(batch, rows=4, length=length)
    (after, attended), out = batch_chunk(graphdef, state, (batch, attended), settings, active,
                                         np.int32(4), chunk_size=4, rows=4)  # fmt: skip
    # The attended slots it hands back are the batch's, written alike: the next chunk of this
    # shape reads them instead of copying them out of the batch again.
    expected = attended_cache(after, rows=4, length=length)
    for got, want in zip(jax.tree.leaves(attended), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    pairs = zip(jax.tree.leaves(before["cache"]), jax.tree.leaves(after["cache"]), strict=True)
    for old, new in pairs:
        np.testing.assert_array_equal(np.asarray(new)[[1, 3]], old[[1, 3]])  # every slot
        np.testing.assert_array_equal(np.asarray(new)[[0, 2], :, 13:], old[[0, 2], :, 13:])
    assert np.asarray(after["pos"]).tolist() == [9, 40, 13, 31]
    assert (np.asarray(out["token"])[[1, 3]] == -1).all()
    alone = empty_batch(model, rows=4)
    alone["cache"] = jax.tree.map(lambda x: x + noise, alone["cache"])
    alone["pos"] = jnp.array([5, 0, 0, 0], jnp.int32)
    alone_carry = (alone, attended_cache(alone, rows=1, length=length))
    _, alone_out = batch_chunk(graphdef, state, alone_carry, settings,
                               jnp.array([True] + [False] * 3), np.int32(4), chunk_size=4,
                               rows=1)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out["token"])[0], np.asarray(alone_out["token"])[0])


def test_a_chunk_scores_its_tokens_only_when_a_busy_row_asked_for_log_probabilities(model):
    # The softmax and top-5 over the vocabulary cost every row every step; a chunk skips
    # them unless a busy row's request wants them, and its tokens are the same either way.
    from flax import nnx

    from model.serving.batch import attended_cache, batch_chunk, batch_settings, empty_batch

    graphdef, state = nnx.split(model)
    active = jnp.array([True, False, True, False])

    def chunk(scored_rows):
        batch = empty_batch(model, rows=4)  # a new one each time: the chunk donates it
        batch["pos"] = jnp.array([3, 0, 7, 0], jnp.int32)
        settings = batch_settings(4)
        settings["temperature"][:] = 0.8
        settings["scored"][scored_rows] = True
        carry = (batch, attended_cache(batch, rows=4, length=32))
        _, out = batch_chunk(graphdef, state, carry, jax.tree.map(jnp.asarray, settings),
                             active, np.int32(4), chunk_size=4, rows=4)  # fmt: skip
        return jax.tree.map(np.asarray, out)

    plain, idle_asked, busy_asked = chunk([]), chunk([1]), chunk([2])
    for out in (plain, idle_asked):
        assert not out["logprob"].any() and not out["top_logprobs"].any()
    np.testing.assert_array_equal(plain["token"], busy_asked["token"])
    logprob, top = busy_asked["logprob"][[0, 2]], busy_asked["top_logprobs"][[0, 2]]
    assert (logprob < 0).all() and (top[..., 0] >= logprob - 1e-6).all()
    assert (np.diff(top, axis=-1) <= 0).all()  # best first


def test_chunks_of_one_shape_read_the_attended_slots_the_chunk_before_left(engine):
    # Copying a chunk's attended slots out of the batch costs more than a step's attention
    # reads; it is made again only when the shape changes or a row is put in.
    counts = {"copies": 0, "chunks": 0}
    kept = dict(engine.programs.attended), dict(engine.programs.chunks)

    def counted(program, name):
        def call(*args, **kwargs):
            counts[name] += 1
            return program(*args, **kwargs)

        return call

    engine.programs.attended.update({k: counted(p, "copies") for k, p in kept[0].items()})
    engine.programs.chunks.update({k: counted(p, "chunks") for k, p in kept[1].items()})
    try:
        tokens = run(engine, [5, 6, 7], 44, sampling=SamplingParams(seed=1, temperature=0.0))
    finally:
        engine.programs.attended.update(kept[0])
        engine.programs.chunks.update(kept[1])
    assert tokens.of("done")[0]["completion_tokens"] == 44, counts
    assert counts["chunks"] >= 11, counts  # 1 step after the admission, then chunks of 4
    assert counts["copies"] == 2, counts  # 32 slots from the admission, then 64 (BLOCK)


def test_requests_that_end_by_length_run_no_step_past_their_max_tokens(engine):
    # The engine counts the steps it launched for each request: a row sits out once they
    # cover its max_tokens, and a chunk is no longer than the longest remaining need (it
    # used to run every row one chunk more, whose tokens were dropped).
    launched = []  # (steps, rows computed for a request) of every chunk
    kept = dict(engine.programs.chunks)

    def counted(program):
        def call(*args, **kwargs):
            launched.append((int(args[-1]), int(np.asarray(args[-2]).sum())))
            return program(*args, **kwargs)

        return call

    engine.programs.chunks.update({k: counted(p) for k, p in kept.items()})
    greedy = SamplingParams(seed=1, temperature=0.0)
    try:
        alone = run(engine, [5, 6, 7], 14, sampling=greedy)
        alone_steps = list(launched)
        launched.clear()
        ends = [Collect(), Collect()]
        with engine.inbox.lock:  # both wait when the engine next looks: admitted together
            for collect, max_tokens in zip(ends, (6, 21), strict=True):
                engine.submit(Request([5, 6, 7], max_tokens, collect, sampling=greedy))
        assert all(collect.ended.wait(60) for collect in ends)
    finally:
        engine.programs.chunks.update(kept)
    assert alone.of("done")[0] == {"finish_reason": "length", "prompt_tokens": 3,
                                   "completion_tokens": 14}  # fmt: skip
    assert alone_steps == [(1, 1), (4, 1), (4, 1), (4, 1), (1, 1)]  # 1 + 3 x 4 + 1 = 14
    for collect, max_tokens in zip(ends, (6, 21), strict=True):
        assert collect.of("done")[0]["finish_reason"] == "length"
        assert collect.of("done")[0]["completion_tokens"] == max_tokens
    texts = ["".join(c.of("text")) for c in (alone, *ends)]  # one character a token
    assert texts[1] == texts[0][:6] and texts[2][:14] == texts[0]
    # A chunk's rows share its step count: the 6-token row runs 1 + 4 + 4, then sits out
    # while the 21-token one runs to exactly 21.
    assert launched == [(1, 2), (4, 2), (4, 2), (4, 1), (4, 1), (4, 1)], launched


def test_the_batch_sends_its_settings_to_the_device_only_after_they_change(model):
    from model.serving.batch_state import BatchState

    state = BatchState(model, rows=4)
    busy = np.array([True, False, False, False])
    first = state.device_inputs(busy)
    assert all(a is b for a, b in zip(first, state.device_inputs(busy.copy()), strict=True))
    state.set_row_settings(1, SamplingParams(seed=7, temperature=0.5), stop_token=3, scored=True)
    changed = state.device_inputs(busy)
    assert changed[0] is not first[0]
    assert np.asarray(changed[0]["seed"]).tolist() == [0, 7, 0, 0]
    assert np.asarray(changed[0]["stop"]).tolist() == [-1, 3, -1, -1]
    assert np.asarray(changed[0]["scored"]).tolist() == [False, True, False, False]
    moved = state.device_inputs(np.array([True, True, False, False]))
    assert np.asarray(moved[1]).tolist() == [True, True, False, False]


def test_the_full_batch_attends_over_eighths_of_the_context_and_fewer_rows_over_quarters():
    from model.serving.batch import attention_lengths

    assert attention_lengths(256, fine=True) == [32, 64, 96, 128, 160, 192, 224, 256]
    assert attention_lengths(256, fine=False) == [64, 128, 256]
    assert attention_lengths(1024, fine=True)[:2] == [128, 256]
    assert attention_lengths(64, fine=True) == [32, 64] and attention_lengths(20, True) == [20]


def test_the_engine_decodes_with_the_tied_head_laid_out_d_by_v_and_the_same_logits(engine, model):
    # XLA:CPU multiplies a few rows by the embedding as it lies, [V, D], several times slower
    # than by a [D, V] copy; the engine keeps one and hands it to every program, whose products
    # of several rows multiply by it. One row's product stays --inference's.
    head = engine.head_DxV
    embedding = np.asarray(model.wte.embedding[...])
    assert head is not None and head.shape == embedding.T.shape
    np.testing.assert_array_equal(np.asarray(head), embedding.T)
    programs = [*engine.programs.chunks.values(), *engine.programs.refills.values()]
    assert all(program.keywords["head_DxV"] is head for program in programs)
    untied = tiny_model(seed=3, block_size=BLOCK, tie_embeddings=False)
    assert untied.decoding_head() is None  # its lm_head is [D, V] already

    tokens = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)
    own, _ = model.decode(tokens, model.init_cache(2), 0)
    laid_out, _ = model.decode(tokens, model.init_cache(2), 0, head_DxV=head)
    doubled, _ = model.decode(tokens, model.init_cache(2), 0, head_DxV=2 * head)
    np.testing.assert_allclose(laid_out, own, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(doubled, 2 * np.asarray(own), rtol=1e-5, atol=1e-5)  # it is used
    # --inference hands its programs the copy where several samples decode together.
    assert compile_programs(model, num_samples=2).chunk.keywords["head_DxV"].shape == head.shape
    assert compile_programs(model, num_samples=1).chunk.keywords == {}
    # One row keeps the embedding's own product, --inference's: the same bits, copy or not.
    one_row, _ = model.decode(tokens[:1, :1], model.init_cache(1), 0, head_DxV=2 * head)
    np.testing.assert_array_equal(one_row, model.decode(tokens[:1, :1], model.init_cache(1), 0)[0])
