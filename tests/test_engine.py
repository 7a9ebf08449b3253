"""The serving engine in-process, on a tiny random model: prompt and token log-probabilities
against a full forward pass, prefix reuse against a cold row, one failing request that leaves
the engine serving, and the one set of sampling checks (the batch's compiled chunk alone:
test_batch.py; the stop-string scan: test_stop_text.py)."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.decoding.generate import generate_all
from model.decoding.programs import compile_programs
from model.decoding.sampling_params import SEED_MAX, SamplingParams
from model.network.attention import traced_for
from model.serving.engine import DEFAULT_STREAM_INTERVAL_S, Engine
from model.serving.inbox import Inbox
from model.serving.requests import EngineStopping, QueueFull, Request
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
