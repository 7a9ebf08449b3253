"""The playground page (GET /) in a real browser: Debian's chromium, headless, driven by
Playwright, against a real `tinyllm.py --serve` process.

Checked: the page streams a greedy completion into #output that equals the non-streamed
answer to the same request, shows the model's name, shows a refused request in #status, and
with --api-key refuses while the key field is empty and works once it is filled.

Playwright's own browser download needs the internet, so the test launches the system's
chromium through `executable_path`; without Playwright or a chromium binary it skips.

The screenshot in the docs comes from this test (any served run, the demo's looks best):

    TINYLLM_SCREENSHOT=docs/serving-playground.png TINYLLM_PLAYGROUND_RUN=runs/shakespeare \\
        pytest tests/test_playground.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
sync_api = pytest.importorskip("playwright.sync_api")

from tests.serve_helpers import ServerProcess  # noqa: E402
from tests.tiny_runs import ROOT, train_tiny_run  # noqa: E402

expect = sync_api.expect
CHROMIUM = ["/usr/bin/chromium", "chromium", "chromium-browser"]
GIVEN_RUN = os.environ.get("TINYLLM_PLAYGROUND_RUN", "")
# The demo's run gets the demo's prompt and a longer answer (the screenshot); the tiny char run
# knows only the corpus's letters.
PROMPT, MAX_TOKENS = ("ROMEO:", 120) if GIVEN_RUN else ("to be", 30)
WAIT_MS = 60_000  # a cold machine may be slow to answer the first request
KEY = "playground-secret"


def find_chromium() -> str | None:
    for name in CHROMIUM:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    path = find_chromium()
    if path is None:
        pytest.skip("no chromium binary (apt-get install chromium): the playground is not tested")
    with sync_api.sync_playwright() as playwright:
        # As root (containers, CI) chromium refuses to start with its sandbox on.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = playwright.chromium.launch(executable_path=path, headless=True, args=args)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """TINYLLM_PLAYGROUND_RUN (copied), or a tiny char run trained here: 60 steps, enough for
    greedy text that is not one repeated token."""
    base = tmp_path_factory.mktemp("playground")
    if GIVEN_RUN:
        return Path(shutil.copytree(GIVEN_RUN, base / Path(GIVEN_RUN).resolve().name))
    return train_tiny_run(base, "train.max_steps=60", "train.eval_interval=30")


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1000, "height": 700})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    yield page
    context.close()


def generate(page, prompt: str, max_tokens: int) -> None:
    """Fill the form (temperature 0), click Generate, wait until the button is back."""
    page.fill("#prompt", prompt)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.click("#generate")
    expect(page.locator("#status")).not_to_have_text(re.compile("generating"), timeout=WAIT_MS)
    expect(page.locator("#generate")).to_be_enabled(timeout=WAIT_MS)


def greedy_answer(url: str, prompt: str, max_tokens: int, key: str = "") -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def test_the_page_streams_the_greedy_completion(page, run_dir, tmp_path):
    with ServerProcess(run_dir, "serve.batch_size=2") as server:
        page.goto(server.url + "/")
        expect(page.locator("#model")).to_have_text(f"model {run_dir.name}", timeout=WAIT_MS)
        assert page.input_value("#temperature") == "0.8"
        assert page.input_value("#max-tokens") == "200"
        assert page.get_attribute("#api-key", "type") == "password"

        generate(page, PROMPT, MAX_TOKENS)
        expect(page.locator("#status")).to_have_text(re.compile(r"^done"))
        shown = page.text_content("#output")
        assert len(set(shown)) > 2 and shown == greedy_answer(server.url, PROMPT, MAX_TOKENS)
        shot = tmp_path / "playground.png"
        page.screenshot(path=str(shot))
        target = os.environ.get("TINYLLM_SCREENSHOT")
        if target:
            shutil.copyfile(shot, ROOT / target)

        # An empty field is left out (the server's default), not sent as 0 (greedy).
        page.fill("#temperature", "")
        with page.expect_request("**/v1/completions") as sent:
            page.click("#generate")
        assert "temperature" not in json.loads(sent.value.post_data)
        expect(page.locator("#generate")).to_be_enabled(timeout=WAIT_MS)

        # A refused request: its JSON error message, shown in #status as an error.
        generate(page, PROMPT, 100_000)
        status = page.locator("#status")
        expect(status).to_have_class("error")
        expect(status).to_contain_text("above this server's limit")
        assert page.text_content("#output") == ""


def test_the_api_key_field_is_sent_as_a_bearer_token(page, run_dir):
    with ServerProcess(run_dir, "serve.batch_size=2", "--api-key", KEY) as server:
        page.goto(server.url + "/")
        generate(page, PROMPT, MAX_TOKENS)
        expect(page.locator("#status")).to_have_class("error")
        expect(page.locator("#status")).to_contain_text("API key")
        assert page.text_content("#output") == ""
        assert page.text_content("#model") == ""  # /v1/models was refused too

        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        expect(page.locator("#model")).to_have_text(f"model {run_dir.name}")
        generate(page, PROMPT, MAX_TOKENS)
        expect(page.locator("#status")).to_have_text(re.compile(r"^done"))
        expected = greedy_answer(server.url, PROMPT, MAX_TOKENS, key=KEY)
        assert expected and page.text_content("#output") == expected
