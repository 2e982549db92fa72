"""A real headless Chromium (Debian's `chromium` and `chromium-driver`) driven by
selenium, for the browser tests: one per module, its blocking calls run in a thread so
that the test's own event loop keeps serving the pages. Screenshots go to
$RUNPLANE_UI_ARTIFACTS (default tests/ui/artifacts/), kept as the test run's artifacts.
axe-core (tests/ui/vendor, from its npm package) is run in the page for accessibility."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
HERE = Path(__file__).parent
ARTIFACTS = Path(os.environ.get("RUNPLANE_UI_ARTIFACTS", HERE / "artifacts"))
AXE = (HERE / "vendor" / "axe.min.js").read_text()
BLOCKING = ("serious", "critical")  # axe impacts a page may not have
WAIT_S = 30.0


def _binaries() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


class Chrome:
    """The browser, with async wrappers around selenium's blocking calls."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.to_thread(fn)

    async def open(self, url: str) -> None:
        await self.call(lambda: self.driver.get(url))

    async def until(self, condition: Callable[[Any], T], what: str) -> T:
        """Poll `condition(driver)` (bounded) until it is truthy. An element found and then
        replaced before it is read (the page reloaded between the two: seen in CI) is
        polled again, as one not found yet is."""
        from selenium.common.exceptions import (
            NoSuchElementException,
            StaleElementReferenceException,
        )
        from selenium.webdriver.support.ui import WebDriverWait

        ignored = (NoSuchElementException, StaleElementReferenceException)
        wait = WebDriverWait(self.driver, WAIT_S, poll_frequency=0.1, ignored_exceptions=ignored)
        return await self.call(lambda: wait.until(condition, message=what))

    async def gone(self, element: Any, what: str) -> None:
        """Wait until `element` left the page (a form posted, a page replaced). Chromium
        may say so as "Node with given id does not belong to the document" rather than a
        stale reference, when the page changes under the check (seen in CI)."""
        from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

        def left(_: Any) -> bool:
            try:
                element.is_enabled()
            except StaleElementReferenceException:
                return True
            except WebDriverException as e:
                if "does not belong to the document" in str(e):
                    return True
                raise
            return False

        await self.until(left, what)

    async def css(self, selector: str) -> Any:
        from selenium.webdriver.common.by import By

        return await self.call(lambda: self.driver.find_element(By.CSS_SELECTOR, selector))

    async def all(self, selector: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        found: list[Any] = await self.call(
            lambda: self.driver.find_elements(By.CSS_SELECTOR, selector)
        )
        return found

    async def text(self, selector: str) -> str:
        """The element's text; looked up again if the live feed swapped it between the
        lookup and the read (StaleElementReferenceException: seen under load)."""
        from selenium.common.exceptions import StaleElementReferenceException

        for _ in range(20):
            element = await self.css(selector)
            try:
                return await self._text_of(element)
            except StaleElementReferenceException:
                continue
        return await self._text_of(await self.css(selector))

    async def _text_of(self, element: Any) -> str:
        return str(await self.call(lambda: element.text))

    async def js(self, script: str, *args: Any) -> Any:
        return await self.call(lambda: self.driver.execute_script(script, *args))

    async def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        await self.call(lambda: self.driver.save_screenshot(str(path)))
        return path

    async def axe(self) -> list[dict[str, Any]]:
        """The page's serious and critical axe-core violations (none is the goal)."""

        def run() -> list[dict[str, Any]]:
            self.driver.execute_script(AXE)
            result = self.driver.execute_async_script(
                "const done = arguments[arguments.length - 1];"
                "axe.run(document, {resultTypes: ['violations']})"
                ".then(r => done(r.violations)).catch(e => done([{impact: 'critical',"
                " id: 'axe-error', help: String(e), nodes: []}]));"
            )
            return [v for v in result if v.get("impact") in BLOCKING]

        return await self.call(run)


@pytest.fixture(name="chrome", scope="module")
def chrome_fixture() -> Iterator[Chrome]:
    """One headless Chromium for the module's tests; skipped loudly where none is
    installed (./dev test installs it as root; CI has it)."""
    found = _binaries()
    if found is None:
        pytest.skip(
            "NO BROWSER: chromium and chromium-driver are not installed, the browser "
            "tests did not run (apt-get install chromium chromium-driver, or ./dev test as root)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in CI and here: Chromium's sandbox refuses to run as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(found[1]), options=options)
    driver.set_script_timeout(WAIT_S)
    try:
        yield Chrome(driver)
    finally:
        driver.quit()
