"""Headless Chromium driven over the Chrome DevTools Protocol (aiohttp's WebSocket client), for loading workflows
into ComfyUI's real frontend.

    with start_chromium(tmp_path) as browser:
        report = asyncio.run(load_workflow(browser, "http://127.0.0.1:8188", workflow, timeout=60))

`load_workflow` opens the ComfyUI page in a new tab, waits for the app, loads the workflow the way an import does
(`app.loadGraphData`), and returns what went wrong on the way (console errors, uncaught exceptions, error log
entries, node types the frontend does not know, widget values that did not land on their widgets) and a PNG
screenshot of the loaded graph.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
START_TIMEOUT_S = 60
# Failed requests every ComfyUI page load makes, with or without the pack: optional files a fresh user folder lacks,
# and the release check on api.comfy.org (no internet here). Any other failed request is an error.
BASELINE_REQUESTS = ("/user.css", "/favicon.ico", "/api/userdata?dir=workflows&", "/api/userdata?dir=subgraphs&",
                     "/api/userdata/comfy.templates.json", "https://api.comfy.org/")


def chromium_binary() -> str | None:
    return os.environ.get("CHROMIUM") or next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


@dataclass
class Browser:
    process: subprocess.Popen
    port: int
    log_file: Path

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_file.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def start_chromium(tmp: Path, binary: str | None = None, width: int = 1600, height: int = 1000):
    """A headless Chromium with its DevTools port picked by itself (read back from DevToolsActivePort)."""
    binary = binary or chromium_binary()
    profile = Path(tmp) / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    port_file = profile / "DevToolsActivePort"
    port_file.unlink(missing_ok=True)  # left by an earlier run in this profile
    log_file = Path(tmp) / "chromium.log"
    cmd = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--remote-debugging-port=0", f"--user-data-dir={profile}", f"--window-size={width},{height}",
           "--no-first-run", "--no-default-browser-check", "about:blank"]
    with open(log_file, "wb") as log:
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (port_file.is_file() and port_file.read_text().strip()):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Chromium did not start ({' '.join(cmd)}):\n"
                                   f"{log_file.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield Browser(process, int(port_file.read_text().split()[0]), log_file)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


class Tab:
    """One page target: commands by id, and the console / exception / log events it reports."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.next_id = 0
        self.pending: dict[int, asyncio.Future] = {}
        self.errors: list[str] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self):
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            if "id" in data:
                future = self.pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            else:
                self._event(data.get("method"), data.get("params", {}))
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the DevTools connection closed"))

    def _event(self, method: str, params: dict) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append("console.error: " + " ".join(_remote_text(a) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            self.errors.append(f"uncaught exception: {text}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            if entry.get("source") == "network" and any(p in entry.get("url", "") for p in BASELINE_REQUESTS):
                return
            self.errors.append(f"log error ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")

    async def send(self, method: str, timeout: float = 30, **params) -> dict:
        self.next_id += 1
        future = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = future
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        reply = await asyncio.wait_for(future, timeout)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def evaluate(self, expression: str, timeout: float = 30):
        """The JSON value of a JavaScript expression (a promise is awaited)."""
        reply = await self.send("Runtime.evaluate", timeout=timeout, expression=expression, awaitPromise=True,
                                returnByValue=True)
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            raise RuntimeError(f"JavaScript failed: {details.get('exception', {}).get('description') or details}")
        return reply["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
            await asyncio.sleep(0.25)


def _remote_text(arg: dict) -> str:
    if "value" in arg:
        return str(arg["value"])
    return arg.get("description") or arg.get("type", "?")


# Runs in the page after the workflow loaded: what the frontend made of every node of it.
GRAPH_REPORT_JS = """
(workflow) => {
  const problems = [];
  const registered = window.LiteGraph?.registered_node_types ?? {};
  for (const saved of workflow.nodes) {
    const node = window.app.graph.getNodeById(saved.id);
    const where = `node ${saved.id} (${saved.type})`;
    if (!node) { problems.push(`${where}: not in the loaded graph`); continue; }
    if (!(saved.type in registered)) problems.push(`${where}: node type unknown to the frontend`);
    if (node.has_errors) problems.push(`${where}: the frontend marked it as broken (has_errors)`);
    const widgets = (node.widgets ?? []).filter((w) => w.serialize !== false);
    const values = saved.widgets_values ?? [];
    if (widgets.length !== values.length) {
      problems.push(`${where}: ${values.length} saved widget values for ${widgets.length} widgets ` +
                    `(${widgets.map((w) => w.name).join(", ")})`);
      continue;
    }
    widgets.forEach((w, i) => {
      const saved_value = values[i];
      if (JSON.stringify(w.value) !== JSON.stringify(saved_value))
        problems.push(`${where}: widget ${w.name} shows ${JSON.stringify(w.value)}, the workflow saved ` +
                      `${JSON.stringify(saved_value)}`);
      const choices = w.options?.values;
      if (w.type === "combo" && Array.isArray(choices) && !choices.includes(w.value))
        problems.push(`${where}: widget ${w.name} = ${JSON.stringify(w.value)} is not one of its choices ` +
                      `${JSON.stringify(choices)}`);
      if (w.type === "number" && ((w.options?.min != null && w.value < w.options.min) ||
                                  (w.options?.max != null && w.value > w.options.max)))
        problems.push(`${where}: widget ${w.name} = ${w.value} is outside ${w.options.min}..${w.options.max}`);
    });
  }
  const dialogs = [...document.querySelectorAll(".p-dialog")].map((d) => d.innerText.trim().slice(0, 300));
  return {problems, dialogs, missing: window.__h3forgeMissing ?? null,
          nodes: window.app.graph.nodes.length, links: Object.keys(window.app.graph.links ?? {}).length};
}
"""

# Previews drawn on the canvas (node.imgs: Load Image) and held in DOM widgets (<video>: Load Video) have loaded.
MEDIA_LOADED_JS = """
window.app.graph.nodes.every((n) => (n.imgs ?? []).every((i) => i.complete && i.naturalWidth > 0)) &&
[...document.querySelectorAll("video")].every((v) => v.readyState >= 2) &&
(window.app.canvas.setDirty(true, true), true)
"""
MEDIA_WAIT_S = 15

# Registered before the load: the frontend hands this hook the node types it found no definition for.
MISSING_HOOK_JS = """
window.app.registerExtension({
  name: "h3forge.test.missing-nodes",
  async afterConfigureGraph(missing) {
    window.__h3forgeMissing = (missing ?? []).map((m) => (typeof m === "string" ? m : m.type));
  },
});
true
"""


@dataclass
class LoadReport:
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, error log entries
    problems: list[str] = field(default_factory=list)  # missing node types, widget values that did not map
    dialogs: list[str] = field(default_factory=list)  # dialogs open after the load (missing nodes, errors)
    missing: list[str] = field(default_factory=list)
    nodes: int = 0
    screenshot: bytes = b""

    def failures(self) -> list[str]:
        return (self.errors + self.problems + [f"missing node type {t}" for t in self.missing]
                + [f"dialog open: {d!r}" for d in self.dialogs])


async def load_workflow(browser: Browser, comfy_url: str, workflow: dict, timeout: float = 90,
                        settle_s: float = 1.5) -> LoadReport:
    """Loads `workflow` into the ComfyUI page at `comfy_url` in a new tab of `browser`; see the module doc."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        async with http.put(f"http://127.0.0.1:{browser.port}/json/new?about:blank") as reply:
            target = await reply.json()
        try:
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                tab = Tab(ws)
                for domain in ("Runtime", "Log", "Page"):
                    await tab.send(f"{domain}.enable")
                # Each tab starts as a first visit: the frontend restores the workflow it stored last (a previous
                # check's, maybe with a missing node whose dialog would stay open over this one).
                await tab.send("Storage.clearDataForOrigin", origin=comfy_url.rstrip("/"),
                               storageTypes="local_storage,session_storage")
                await tab.send("Page.navigate", url=comfy_url)
                # The app is up once it has loaded its start graph (ComfyUI's default workflow).
                await tab.wait_for("!!(window.app?.graph?.nodes?.length && window.app.canvas && window.LiteGraph)",
                                   deadline - time.monotonic(), "the ComfyUI app starting in the page")
                await asyncio.sleep(settle_s)
                await tab.evaluate(MISSING_HOOK_JS)
                await tab.evaluate(f"window.app.loadGraphData({json.dumps(workflow)}).then(() => true)",
                                   timeout=deadline - time.monotonic())
                await tab.evaluate('Promise.resolve(window.app.extensionManager.command.execute("Comfy.Canvas.FitView"))'
                                   '.then(() => true)')  # the whole graph in the screenshot
                await asyncio.sleep(settle_s)  # late errors (widget callbacks) and a drawn canvas
                with contextlib.suppress(TimeoutError):  # image and video previews in the screenshot, if they load
                    await tab.wait_for(MEDIA_LOADED_JS, min(MEDIA_WAIT_S, deadline - time.monotonic()), "media")
                    await asyncio.sleep(0.5)  # the canvas redraws on the next animation frame
                result = await tab.evaluate(f"({GRAPH_REPORT_JS})({json.dumps(workflow)})")
                shot = await tab.send("Page.captureScreenshot", format="png", timeout=deadline - time.monotonic())
                tab.reader.cancel()
                if result["missing"] is None:
                    result["problems"].append("the frontend never reached afterConfigureGraph for this workflow")
                return LoadReport(errors=list(tab.errors), problems=result["problems"], dialogs=result["dialogs"],
                                  missing=result["missing"] or [], nodes=result["nodes"],
                                  screenshot=base64.b64decode(shot["data"]))
        finally:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(f"http://127.0.0.1:{browser.port}/json/close/{target['id']}"):
                    pass
