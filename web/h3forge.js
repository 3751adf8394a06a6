// H3Forge frontend extension: engine status and job progress drawn under the H3Forge nodes.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const POLL_MS = 4000;
const LINE_HEIGHT = 14;
const engine = { reply: null };          // last /h3forge/status answer
const progressText = new Map();           // node id -> latest progress text from the backend
let runningNode = null;                   // id of the node ComfyUI is executing

// H3Forge nodes that never talk to the engine: no engine line under them.
const OFFLINE = new Set(["H3ForgePreview", "H3ForgeMaskFrameRange", "H3ForgeMaskTrackBox", "H3ForgeMaskGrow",
                         "H3ForgeMaskFeather", "H3ForgeLora"]);

const isH3 = (node) => String(node?.comfyClass ?? node?.type ?? "").startsWith("H3Forge");
const h3Nodes = () => (app.graph?._nodes ?? []).filter(isH3);
const redraw = () => app.graph?.setDirtyCanvas(true, false);

function gib(bytes) {
  return (bytes / 2 ** 30).toFixed(1);
}

function engineLine() {
  const reply = engine.reply;
  if (!reply) return "engine: checking…";
  if (!reply.connected) {
    if (reply.launched) return "engine: starting…";
    return `engine: not running at ${reply.url}` + (reply.auto_launch ? " (starts on Queue)" : "");
  }
  const s = reply.status ?? {};
  const parts = [s.engine?.state === "loading" ? "engine: loading models" : "engine: connected"];
  const queued = (s.queue ?? []).length;
  const job = s.running;
  if (job) parts.push(job.total ? `${job.stage ?? "running"} ${job.step}/${job.total}` : "running");
  parts.push(`queue ${queued}`);
  if (s.gpu) parts.push(`GPU ${gib(s.gpu.used_bytes)}/${gib(s.gpu.total_bytes)} GiB`);
  else if (s.engine?.device) parts.push(s.engine.device);
  return parts.join(" · ");
}

async function poll() {
  if (h3Nodes().length === 0) return;
  try {
    const res = await api.fetchApi("/h3forge/status");
    engine.reply = res.ok ? await res.json() : { connected: false, url: "?", launched: false };
  } catch {
    engine.reply = null;
  }
  redraw();
}

// Which files, formats and compute precisions the engine loaded (under the Engine node).
function weightsLine() {
  const summary = engine.reply?.connected ? engine.reply.status?.models?.summary : null;
  return summary ? `weights: ${summary}` : null;
}

function drawStatus(node, ctx) {
  if (node.flags?.collapsed) return;
  const lines = [];
  if (!OFFLINE.has(node.comfyClass)) lines.push(engineLine());
  const weights = node.comfyClass === "H3ForgeEngine" ? weightsLine() : null;
  if (weights) lines.push(weights);
  const running = runningNode === String(node.id);
  const text = progressText.get(String(node.id));
  if (running && text) lines.push(text);
  if (lines.length === 0) return;
  ctx.save();
  ctx.font = "11px sans-serif";
  ctx.textAlign = "left";
  ctx.fillStyle = running ? "#7fd17f" : "#999";
  lines.forEach((line, i) => ctx.fillText(line, 6, node.size[1] + LINE_HEIGHT * (i + 1)));
  ctx.restore();
}

app.registerExtension({
  name: "H3Forge.EngineStatus",

  setup() {
    api.addEventListener("progress_text", ({ detail }) => {
      if (!detail?.nodeId) return;
      progressText.set(String(detail.nodeId), detail.text);
      redraw();
    });
    api.addEventListener("executing", ({ detail }) => {
      const id = detail && typeof detail === "object" ? detail.node : detail;
      runningNode = id == null ? null : String(id);
      if (runningNode && isH3(app.graph?.getNodeById?.(runningNode))) poll();
      redraw();
    });
    api.addEventListener("progress", ({ detail }) => {
      if (detail?.node && isH3(app.graph?.getNodeById?.(detail.node))) redraw();
    });
    api.addEventListener("execution_start", () => progressText.clear());
    setInterval(poll, POLL_MS);
    poll();
  },

  nodeCreated(node) {
    if (!isH3(node)) return;
    const draw = node.onDrawForeground;
    node.onDrawForeground = function (ctx) {
      const result = draw?.apply(this, arguments);
      drawStatus(this, ctx);
      return result;
    };
    poll();
  },
});
