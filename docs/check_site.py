"""Check the built site in a real headless browser (Chromium), over no network.

    python docs/check_site.py [SITE_DIR] [--screenshots DIR] [--chromium PATH]

SITE_DIR (default: site, what ``make docs`` builds) is served on 127.0.0.1, and Chromium,
driven through the DevTools protocol over a pipe (no extra Python package), checks that:

1. every page loads with no console error, no uncaught exception and no failed request;
2. the search box finds ``DistributedOptimizer`` (Material's client-side search);
3. the API page of ``hvdlite.torch`` lists ``DistributedOptimizer``'s parameters.

With ``--screenshots DIR`` it saves a guide and the API page there. Exit status 0 when
all pass, 1 when one fails, 0 with a ``SKIP`` line when no Chromium is found (``make
docs-check`` runs it; ``make test`` does not).
"""
from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

SEARCH_TERM = "DistributedOptimizer"
API_PAGE = "api/torch.html"
API_ANCHOR = "hvdlite.torch.optimizer.DistributedOptimizer"
PARAMETERS = ("optimizer", "named_parameters", "compression", "backward_passes_per_step", "op",
              "gradient_predivide_factor", "groups", "sparse_as_dense", "process_set")
GUIDE_PAGE = "guide/performance.html"
CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


class Browser:
    """Chromium with --remote-debugging-pipe: JSON messages ended by NUL on fds 3 and 4."""

    def __init__(self, executable: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        self._profile = tempfile.mkdtemp(prefix="hvdlite-check-site-")

        def pipes() -> None:        # in the child: its fd 3 reads commands, fd 4 answers
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.process = subprocess.Popen(
            [executable, "--headless=new", "--remote-debugging-pipe", "--no-sandbox",
             "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--disable-sync",
             "--disable-background-networking", "--disable-component-update",
             f"--user-data-dir={self._profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=pipes, close_fds=False)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._replies: dict[int, queue.Queue] = {}
        self.events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        self.session = ""

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message and message["id"] in self._replies:
                    self._replies[message["id"]].put(message)
                else:
                    self.events.put(message)

    def call(self, method: str, timeout: float = 30, session: Optional[str] = None,
             **params: Any) -> dict:
        with self._lock:
            self._next_id += 1
            ident = self._next_id
            self._replies[ident] = queue.Queue()
        message = {"id": ident, "method": method, "params": params}
        session = self.session if session is None else session
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        try:
            reply = self._replies[ident].get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no answer to {method} within {timeout} s") from None
        finally:
            del self._replies[ident]
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def open_tab(self) -> None:
        target = self.call("Target.createTarget", session="", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", session="", targetId=target,
                                 flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=900,
                  deviceScaleFactor=1, mobile=False)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def drain(self) -> list[dict]:
        found = []
        while True:
            try:
                found.append(self.events.get_nowait())
            except queue.Empty:
                return found

    def load(self, url: str, settle: float = 0.6, timeout: float = 30) -> list[str]:
        """Navigate and wait for the load event; the problems the page reported."""
        self.drain()
        self.call("Page.navigate", url=url)
        events: list[dict] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            events.append(event)
            if event.get("method") == "Page.loadEventFired":
                break
        else:
            return [f"{url}: no load event within {timeout} s"]
        time.sleep(settle)                  # scripts run after load (search index, etc.)
        events += self.drain()
        return problems(url, events)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close", session="", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        shutil.rmtree(self._profile, ignore_errors=True)


def problems(url: str, events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions and failed requests among a page's events."""
    found = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            found.append(f"{url}: console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text")
            found.append(f"{url}: uncaught exception: {text}")
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            found.append(f"{url}: {entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            found.append(f"{url}: request failed: {params.get('errorText')}")
    return found


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:   # noqa: A002
        pass


def pages(site: Path) -> list[str]:
    """Every page's URL path ("" for the home page)."""
    urls = []
    for path in site.rglob("*.html"):
        relative = path.relative_to(site)
        if path.name != "index.html":
            urls.append(str(relative))
        elif relative.parent != Path("."):
            urls.append(f"{relative.parent}/")
        else:
            urls.append("")
    return sorted(urls)


def wait_for(browser: Browser, expression: str, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = browser.evaluate(expression)
        if value:
            return value
        time.sleep(0.25)
    return value


def check_search(browser: Browser, base: str) -> list[str]:
    failures = browser.load(base)
    browser.evaluate("document.querySelector('label.md-search__icon, label[for=__search]')"
                     "?.click(); document.querySelector('.md-search__input').focus(); true")
    browser.call("Input.insertText", text=SEARCH_TERM)
    titles = wait_for(browser, "Array.from(document.querySelectorAll("
                               "'.md-search-result__item')).map(e => e.innerText)")
    if not titles or not any(SEARCH_TERM in t for t in titles):
        failures.append(f"search for {SEARCH_TERM!r} found nothing that names it: {titles}")
    else:
        print(f"search: {len(titles)} results for {SEARCH_TERM!r}, the first: "
              f"{titles[0].splitlines()[0]!r}")
    return failures


def check_api(browser: Browser, base: str) -> list[str]:
    failures = browser.load(base + API_PAGE + "#" + API_ANCHOR)
    names = browser.evaluate(f"""(() => {{
        const heading = document.getElementById({json.dumps(API_ANCHOR)});
        if (!heading) return null;
        const object = heading.closest('.doc-object') || heading.parentElement;
        const section = Array.from(object.querySelectorAll('.doc-section-title'))
            .find(e => e.textContent.trim().startsWith('Parameters'));
        if (!section) return [];
        const table = (section.closest('p') || section).nextElementSibling;
        if (!table) return [];
        return Array.from(table.querySelectorAll('tbody tr td:first-child code'))
            .map(e => e.textContent.trim());
    }})()""")
    if names is None:
        return failures + [f"{API_PAGE}: no element with id {API_ANCHOR}"]
    missing = [p for p in PARAMETERS if p not in names]
    if missing:
        failures.append(f"{API_PAGE}: DistributedOptimizer's parameters lack {missing} "
                        f"(found {names})")
    else:
        print(f"API: DistributedOptimizer lists its {len(PARAMETERS)} parameters")
    return failures


def find_chromium(given: Optional[str]) -> Optional[str]:
    if given:
        return given
    return next((shutil.which(name) for name in CANDIDATES if shutil.which(name)), None)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", default="site", type=Path)
    parser.add_argument("--screenshots", type=Path, help="save a guide and the API page here")
    parser.add_argument("--chromium", help="the browser (default: chromium on PATH)")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"FAIL: {args.site}/index.html does not exist: build the site first (make docs)")
        return 1
    executable = find_chromium(args.chromium)
    if executable is None:
        print("SKIP: no Chromium found (Debian: apt-get install chromium); nothing checked")
        return 0
    server, base = serve(args.site)
    browser = Browser(executable)
    failures: list[str] = []
    try:
        browser.open_tab()
        every = pages(args.site)
        for page in every:
            failures += browser.load(base + page)
        print(f"pages: {len(every)} loaded, {len(failures)} problems")
        failures += check_search(browser, base)
        failures += check_api(browser, base)
        if args.screenshots:
            args.screenshots.mkdir(parents=True, exist_ok=True)
            browser.load(base + GUIDE_PAGE)
            browser.screenshot(args.screenshots / "guide-performance.png")
            browser.load(base + API_PAGE + "#" + API_ANCHOR)
            browser.screenshot(args.screenshots / "api-torch-DistributedOptimizer.png")
            print(f"screenshots: {args.screenshots}/guide-performance.png, "
                  f"{args.screenshots}/api-torch-DistributedOptimizer.png")
    finally:
        browser.close()
        server.shutdown()
    for failure in failures:
        print("FAIL:", failure)
    print("site check:", "failed" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
