"""The chat page at /, in a real headless browser: Debian's Chromium driven by Selenium through its
chromedriver, against a live server on the default model. Type a message and see the streamed
answer with its counts; press stop mid-answer and see the server free the request's blocks; edit
a turn; reload and find the conversation; a server with a key asks for it once. A screenshot of
the page is kept in test-output/ (TRILLM_TEST_OUTPUT)."""
import functools
import os
import re

import pytest
import trio

from http_support import live_server, requests_served, settled_stats

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 60  # how long a step may take before the test fails (not a speed check)
OUTPUT = os.environ.get("TRILLM_TEST_OUTPUT", os.path.join(os.path.dirname(__file__), os.pardir, "test-output"))


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One Chromium for the file (each test's server is its own origin, so its own storage)."""
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium chromium-driver; .ci/run installs it)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # without the background-networking flags Chromium keeps dialling out, and a closed network refuses it
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,860", f"--user-data-dir={tmp_path_factory.mktemp('profile')}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def in_browser(fn, *args):
    """Selenium blocks: its calls run in a thread while the server goes on serving in this one."""
    return trio.to_thread.run_sync(functools.partial(fn, *args))


def wait(driver, condition):
    """`condition(driver)` once it holds; the page re-renders as tokens arrive, so an element a
    check found may be gone by the time it reads it: that check is tried again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05,
                         ignored_exceptions=[StaleElementReferenceException]).until(lambda d: condition(d))


def texts(driver, selector: str) -> list[str]:
    """The rendered text of every element `selector` matches, read in one step of the page."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), (e) => e.innerText)", selector)


def find(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def set_field(driver, element_id: str, value: str) -> None:
    (field,) = find(driver, f"#{element_id}")
    field.clear()
    field.send_keys(value)


def fresh_page(driver, url: str) -> None:
    """The page with nothing kept from before: a port an earlier test's server had is the same
    origin, with the same storage."""
    driver.get(url + "/ui/style.css")  # the origin, without the page's scripts
    driver.execute_script("localStorage.clear()")
    driver.get(url + "/")


def open_page(driver, url: str, model: str) -> None:
    fresh_page(driver, url)
    wait(driver, lambda d: [o.get_attribute("value") for o in find(d, "#model option")] == [model])


def ask(driver, text: str) -> None:
    set_field(driver, "prompt", text + "\n")  # Enter sends


def finished_answer(driver, index: int) -> tuple[str, str]:
    """The content and stats of message `index` once its answer ended (its actions shown)."""
    return wait(driver, lambda d: d.execute_script(
        "const m = document.querySelectorAll('.message')[arguments[0]];"
        "return m && m.querySelector('.actions') ? [m.querySelector('.content').innerText,"
        " m.querySelector('.stats').innerText] : null;", index))


async def test_chat_streams_stops_edits_and_is_remembered(server, browser):
    await in_browser(open_page, browser, server.url, server.model)

    def first_question():
        find(browser, "#settings-toggle")[0].click()
        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", "12")
        ask(browser, "Name three colors.")
        return finished_answer(browser, 1)

    text, stats = await in_browser(first_question)
    chat = await server.openai().chat.completions.create(model=server.model, max_tokens=12, temperature=0,
                                                         messages=[{"role": "user", "content": "Name three colors."}])
    assert text and stats.startswith("12 tokens · ") and "tok/s" in stats
    assert stats.endswith(f"prompt {chat.usage.prompt_tokens} tokens")
    # the page renders the answer's Markdown: bold marks and list markers are not in its text
    rendered = re.sub(r"(?m)^\s*(?:\d+\.|[-*+])\s+", "", chat.choices[0].message.content).replace("*", "")
    assert " ".join(text.split()) == " ".join(rendered.split())

    def long_answer_started():
        set_field(browser, "max_tokens", "4000")
        ask(browser, "Write a long story about a dragon.")
        wait(browser, lambda d: len(contents := texts(d, ".message .content")) == 4 and len(contents[3]) > 20)

    await in_browser(long_answer_started)
    http = server.http()
    running = (await http.get("/server_info")).json()["stats"]
    assert running["num_live_requests"] == 1 and running["num_used_blocks"] > 0
    await in_browser(lambda: find(browser, "#stop")[0].click())
    stats = await settled_stats(http)  # the page closed its stream: the server aborted the request
    assert stats["num_used_blocks"] == 0
    _, stopped = await in_browser(finished_answer, browser, 3)
    assert stopped == "stopped"

    def edit_first_turn():
        set_field(browser, "max_tokens", "6")
        find(browser, ".message.user .actions .edit")[0].click()
        (area,) = find(browser, ".message.editing textarea")
        area.clear()
        area.send_keys("Name two animals.")
        find(browser, ".message.editing button")[0].click()  # Save & send
        return finished_answer(browser, 1)

    edited, edited_stats = await in_browser(edit_first_turn)
    assert edited_stats.startswith("6 tokens") and len(await in_browser(find, browser, ".message")) == 2

    def reloaded():
        browser.refresh()
        wait(browser, lambda d: len(find(d, ".message")) == 2)
        titles = texts(browser, "#conversations li .open")
        os.makedirs(OUTPUT, exist_ok=True)
        browser.save_screenshot(os.path.join(OUTPUT, "chat-page.png"))
        return titles, texts(browser, ".message .content")

    titles, contents = await in_browser(reloaded)
    assert titles == ["Name three colors."] and contents == ["Name two animals.", edited]


async def test_reasoning_shows_apart_and_regenerate_asks_again(core, browser):
    """With a reasoning parser that reads the whole of this model's output as reasoning
    (deepseek_r1: the template is taken to open <think>), the answer's text is in the collapsed
    reasoning block; Regenerate replaces the answer with a new request's."""
    async with live_server(core, reasoning_parser="deepseek_r1") as server:
        def reasoned():
            open_page(browser, server.url, server.model)
            find(browser, "#settings-toggle")[0].click()
            set_field(browser, "temperature", "0")
            set_field(browser, "max_tokens", "8")
            ask(browser, "Name three colors.")
            finished_answer(browser, 1)
            return browser.execute_script(
                "const d = document.querySelector('.message.assistant details.reasoning');"
                "return d && [d.open, d.querySelector('summary').textContent, d.lastChild.textContent];")

        is_open, summary, reasoning = await in_browser(reasoned)
        assert is_open is False and summary == "Reasoning" and reasoning.strip()
        served = await requests_served(server.url)

        def regenerated():
            find(browser, ".message.assistant .actions .regenerate")[0].click()
            return finished_answer(browser, 1), len(find(browser, ".message"))

        (_, stats), messages = await in_browser(regenerated)
        assert stats.startswith("8 tokens") and messages == 2
        assert await requests_served(server.url) == served + 1


async def test_a_server_with_a_key_is_asked_for_it_once(core, browser):
    async with live_server(core, api_key="sk-page") as server:
        def log_in():
            fresh_page(browser, server.url)
            wait(browser, lambda d: d.execute_script("return document.getElementById('key-dialog').open"))
            set_field(browser, "api-key", "sk-page")
            find(browser, "#key-save")[0].click()
            wait(browser, lambda d: [o.get_attribute("value") for o in find(d, "#model option")] == [server.model])
            browser.refresh()  # the key is kept: no second question
            wait(browser, lambda d: find(d, "#model option"))
            return browser.execute_script("return document.getElementById('key-dialog').open")

        assert await in_browser(log_in) is False


async def test_the_page_is_the_shipped_files_alone_and_no_ui_removes_it(core):
    async with live_server(core, api_key="sk-page") as server:
        http = server.http()
        page = await http.get("/")
        assert page.status_code == 200 and "<title>trillm</title>" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        script = await http.get("/ui/app.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        for name in ("/ui/../chat_page.py", "/ui/index.html.bak", "/ui/%2e%2e/settings.py", "/ui/vendor/LICENSE.marked",
                     "/ui/vendor/../../chat_page.py"):
            response = await http.get(name)
            assert response.status_code in (401, 404) and "import" not in response.text, name
        assert (await http.get("/v1/models")).status_code == 401  # the page's files are open, the API is not
    async with live_server(core, ui=False) as server:
        assert (await server.http().get("/")).status_code == 404
