// sowtel's TensorBoard plugin page: training health across depth and steps.
// Plain ES module, no build step and no network beyond this TensorBoard's own routes.

const LOG_STATS = new Set(["l2", "std", "mean_abs", "max_abs"]);
const WORDS = { primal: "activation", cotangent: "gradient", tangent: "tangent" };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") node.style.cssText = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}

async function getJSON(path) {
  const response = await fetch(path);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function modeLabel(mode) {
  return WORDS[mode] ? `${WORDS[mode]} (${mode})` : mode;
}

function fmtScale(x, logScale) {
  const v = logScale ? Math.pow(10, x) : x;
  return Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(1)
    : v.toPrecision(2);
}

function indexLabel(index) {
  return Array.isArray(index) ? `[${index.join(",")}]` : String(index);
}

// A perceptual ramp from dark blue to yellow (sampled by hand from a viridis-like curve).
const RAMP = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function colour(t) {
  if (!(t >= 0)) t = 0;
  if (t > 1) t = 1;
  const x = t * (RAMP.length - 1);
  const i = Math.min(Math.floor(x), RAMP.length - 2);
  const f = x - i;
  const c = RAMP[i].map((a, k) => Math.round(a + (RAMP[i + 1][k] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

function lineColour(j, n) {
  // Hues spread around the circle, alternating lightness so neighbouring layers differ.
  const hue = Math.round((360 * j) / Math.max(n, 1));
  return `hsl(${hue}, 75%, ${j % 2 ? 35 : 50}%)`;
}

function scaleOf(values, logScale) {
  let lo = Infinity, hi = -Infinity;
  for (const row of values) for (const v of row) {
    if (v === null || (logScale && !(v > 0))) continue;
    const x = logScale ? Math.log10(v) : v;
    if (x < lo) lo = x;
    if (x > hi) hi = x;
  }
  if (lo === Infinity) { lo = 0; hi = 1; }
  if (hi === lo) hi = lo + 1;
  const map = (v) => {
    if (v === null || (logScale && !(v > 0))) return null;
    return ((logScale ? Math.log10(v) : v) - lo) / (hi - lo);
  };
  return { lo, hi, map, logScale };
}

function drawHeatmap(box, data, stat, tooltip) {
  const { steps, index, values, nonfinite } = data;
  const logScale = LOG_STATS.has(stat);
  const scale = scaleOf(values, logScale);
  const width = 1000;
  const rowH = Math.max(4, Math.min(18, Math.floor(420 / Math.max(index.length, 1))));
  const left = 56, top = 8, plotW = width - left - 110, plotH = rowH * index.length;
  const canvas = el("canvas", { width: String(width), height: String(plotH + top + 36),
                                class: "heatmap" });
  const ctx = canvas.getContext("2d");
  const cellW = plotW / Math.max(steps.length, 1);
  for (let i = 0; i < steps.length; i++) {
    for (let j = 0; j < index.length; j++) {
      const bad = nonfinite && nonfinite[i] && nonfinite[i][j] > 0;
      const t = scale.map(values[i][j]);
      ctx.fillStyle = bad ? "#e0006c" : t === null ? "#d8d8d8" : colour(t);
      // Whole pixels: fractional cells would leave hairline gaps between them.
      const x0 = Math.floor(left + i * cellW), x1 = Math.floor(left + (i + 1) * cellW);
      ctx.fillRect(x0, top + j * rowH, Math.max(1, x1 - x0), rowH);
    }
  }
  ctx.fillStyle = "#333";
  ctx.font = "11px sans-serif";
  ctx.textAlign = "right";
  const every = Math.ceil(12 / rowH);
  for (let j = 0; j < index.length; j += every) {
    ctx.fillText(indexLabel(index[j]), left - 4, top + j * rowH + rowH / 2 + 4);
  }
  ctx.textAlign = "center";
  const stepEvery = Math.ceil(steps.length / 8);
  for (let i = 0; i < steps.length; i += stepEvery) {
    ctx.fillText(String(steps[i]), left + (i + 0.5) * cellW, top + plotH + 14);
  }
  ctx.fillText("training step", left + plotW / 2, top + plotH + 30);
  ctx.save();
  ctx.translate(12, top + plotH / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.fillText("layer", 0, 0);
  ctx.restore();
  // Colour bar: orders of magnitude when the scale is logarithmic.
  const barX = left + plotW + 24;
  for (let y = 0; y < plotH; y++) {
    ctx.fillStyle = colour(1 - y / Math.max(plotH - 1, 1));
    ctx.fillRect(barX, top + y, 14, 1);
  }
  ctx.fillStyle = "#333";
  ctx.textAlign = "left";
  ctx.fillText(fmtScale(scale.hi, logScale), barX + 18, top + 10);
  ctx.fillText(fmtScale(scale.lo, logScale), barX + 18, top + plotH);
  if (logScale) ctx.fillText("log scale", barX + 18, top + plotH / 2);
  canvas.addEventListener("mousemove", (ev) => {
    const r = canvas.getBoundingClientRect();
    const i = Math.floor((ev.clientX - r.left - left) / cellW);
    const j = Math.floor((ev.clientY - r.top - top) / rowH);
    if (i < 0 || j < 0 || i >= steps.length || j >= index.length) {
      tooltip.style.display = "none";
      return;
    }
    const v = values[i][j];
    const bad = nonfinite && nonfinite[i] && nonfinite[i][j] > 0
      ? `, ${nonfinite[i][j]} non-finite` : "";
    tooltip.textContent = `step ${steps[i]}, layer ${indexLabel(index[j])}: ${stat} = ` +
      `${v === null ? "n/a" : v.toPrecision(4)}${bad}`;
    tooltip.style.display = "block";
    tooltip.style.left = `${ev.pageX + 12}px`;
    tooltip.style.top = `${ev.pageY + 12}px`;
  });
  canvas.addEventListener("mouseleave", () => { tooltip.style.display = "none"; });
  box.append(canvas);
}

function drawLines(box, data, stat) {
  const { steps, index, values } = data;
  const logScale = LOG_STATS.has(stat);
  const scale = scaleOf(values, logScale);
  const W = 760, H = 300, left = 60, right = 12, top = 10, bottom = 30;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", String(W));
  svg.setAttribute("height", String(H));
  svg.setAttribute("class", "lines");
  const x = (i) => left + ((W - left - right) * i) / Math.max(steps.length - 1, 1);
  const y = (t) => top + (H - top - bottom) * (1 - t);
  const legend = el("div", { class: "legend" });
  for (let j = 0; j < index.length; j++) {
    let d = "";
    for (let i = 0; i < steps.length; i++) {
      const t = scale.map(values[i][j]);
      if (t === null) continue;
      d += `${d ? "L" : "M"}${x(i).toFixed(1)},${y(t).toFixed(1)}`;
    }
    const path = document.createElementNS(ns, "path");
    path.setAttribute("d", d);
    path.setAttribute("fill", "none");
    path.setAttribute("stroke", lineColour(j, index.length));
    path.setAttribute("stroke-width", "1.5");
    const title = document.createElementNS(ns, "title");
    title.textContent = `layer ${indexLabel(index[j])}`;
    path.append(title);
    svg.append(path);
    legend.append(el("span", { class: "key", style: `color:${lineColour(j, index.length)}` },
                     `■ ${indexLabel(index[j])} `));
  }
  const axis = (text, tx, ty, anchor = "start") => {
    const t = document.createElementNS(ns, "text");
    t.setAttribute("x", String(tx));
    t.setAttribute("y", String(ty));
    t.setAttribute("font-size", "11");
    t.setAttribute("text-anchor", anchor);
    t.textContent = text;
    svg.append(t);
  };
  axis(fmtScale(scale.hi, logScale), 4, top + 10);
  axis(fmtScale(scale.lo, logScale), 4, H - bottom);
  if (steps.length) {
    axis(String(steps[0]), left, H - 10);
    axis(String(steps[steps.length - 1]), W - right, H - 10, "end");
  }
  box.append(svg, legend);
}

function healthPanel(health) {
  const panel = el("div", { class: "health", id: "health" });
  if (!health.first) {
    panel.classList.add("ok");
    panel.append("No NaN or infinity recorded in this run.");
    return panel;
  }
  const f = health.first;
  const where = f.site
    ? `site ${f.site}, ${modeLabel(f.mode)}, step ${f.step}` +
      (f.index !== null && f.index !== undefined ? `, index ${indexLabel(f.index)}` : "")
    : f.text;
  panel.append(el("div", { class: "first" }, `First non-finite value: ${where}`));
  const list = el("ul");
  for (const s of health.sites) {
    list.append(el("li", {}, `${s.site}, ${modeLabel(s.mode)}: from step ${s.first_step}, ` +
                               `${s.steps} step(s)`));
  }
  panel.append(list);
  return panel;
}

const STYLE = `
body { font-family: Roboto, sans-serif; margin: 16px; color: #212121; }
h2 { font-size: 16px; margin: 18px 0 6px; }
.health { padding: 8px 12px; border-radius: 4px; background: #fde7ef; margin-bottom: 12px; }
.health.ok { background: #e8f5e9; }
.health .first { font-weight: 600; }
.controls label { margin-right: 14px; font-size: 13px; }
.sites { font-size: 13px; margin: 6px 0; }
.sites span { margin-right: 10px; cursor: pointer; text-decoration: underline; }
.tooltip { position: absolute; display: none; background: #333; color: #fff; font-size: 12px;
           padding: 3px 6px; border-radius: 3px; pointer-events: none; }
.legend { font-size: 11px; max-width: 760px; }
.key { white-space: nowrap; }
.error { color: #b00020; }
.note { font-size: 11px; color: #555; }
`;

export async function render() {
  document.head.append(el("style", {}, STYLE));
  const root = el("div", { id: "sowtel" });
  const tooltip = el("div", { class: "tooltip" });
  document.body.append(root, tooltip);
  let runs;
  try {
    runs = (await getJSON("runs")).runs;
  } catch (e) {
    root.append(el("div", { class: "error" }, `Could not read the runs: ${e.message}`));
    return;
  }
  if (!runs.length) {
    root.append("No run holds sowtel data yet. Stream with sowtel.enable(exporter=" +
                "\"tensorboard\") and this page fills in as steps are written.");
    return;
  }
  const healthBox = el("div");
  const runSel = el("select", { id: "run" });
  const siteSel = el("select", { id: "site" });
  const modeSel = el("select", { id: "mode" });
  const statSel = el("select", { id: "stat" });
  const siteList = el("div", { class: "sites", id: "site-list" });
  const heat = el("div", { id: "heatmap" });
  const lines = el("div", { id: "lines" });
  const status = el("div", { id: "status" });
  for (const r of runs) runSel.append(el("option", { value: r }, r));
  root.append(
    el("h1", { style: "font-size:18px" }, "Training health across depth"),
    healthBox,
    el("div", { class: "controls" },
       el("label", {}, "run ", runSel), el("label", {}, "site ", siteSel),
       el("label", {}, "mode ", modeSel), el("label", {}, "statistic ", statSel)),
    siteList, status,
    el("h2", {}, "Layers × steps"), heat,
    el("div", { class: "note" }, "Grey: the layer did not run that step. " +
       "Magenta: NaN or infinity in the layer's value."),
    el("h2", {}, "One line per layer"), lines,
  );
  let sites = [];

  async function showDepth() {
    heat.replaceChildren();
    lines.replaceChildren();
    const q = new URLSearchParams({ run: runSel.value, site: siteSel.value,
                                    mode: modeSel.value, stat: statSel.value });
    try {
      const data = await getJSON(`depth?${q}`);
      status.textContent = `${data.index.length} layers × ${data.steps.length} steps`;
      drawHeatmap(heat, data, statSel.value, tooltip);
      drawLines(lines, data, statSel.value);
    } catch (e) {
      status.replaceChildren(el("span", { class: "error" }, e.message));
    }
  }

  function fillModes() {
    const site = sites.find((s) => s.site === siteSel.value);
    modeSel.replaceChildren(...site.modes.map((m) => el("option", { value: m }, modeLabel(m))));
    fillStats();
  }

  function fillStats() {
    const site = sites.find((s) => s.site === siteSel.value);
    const preferred = modeSel.value === "primal" ? "std" : "l2";
    statSel.replaceChildren(...site.stats.map((k) => el("option", { value: k }, k)));
    if (site.stats.includes(preferred)) statSel.value = preferred;
  }

  async function showRun() {
    const run = runSel.value;
    const [siteData, health] = await Promise.all([
      getJSON(`sites?run=${encodeURIComponent(run)}`),
      getJSON(`health?run=${encodeURIComponent(run)}`),
    ]);
    healthBox.replaceChildren(healthPanel(health));
    sites = siteData.sites;
    siteSel.replaceChildren(...sites.map((s) => el("option", { value: s.site }, s.site)));
    siteList.replaceChildren(...sites.map((s) => el("span", {
      class: "site-name",
      onclick: () => { siteSel.value = s.site; fillModes(); showDepth(); },
    }, s.site)));
    if (!sites.length) {
      status.textContent = "This run has no site inside a scan or repeated by number.";
      return;
    }
    // Open on the first site that went non-finite, else the first site inside a scan.
    const first = health.first && sites.find((s) => s.site === health.first.site);
    const scan = sites.find((s) => s.kind === "scan");
    siteSel.value = (first || scan || sites[0]).site;
    fillModes();
    if (first && first.modes.includes(health.first.mode)) {
      modeSel.value = health.first.mode;
      fillStats();
    }
    await showDepth();
  }

  runSel.addEventListener("change", showRun);
  siteSel.addEventListener("change", () => { fillModes(); showDepth(); });
  modeSel.addEventListener("change", () => { fillStats(); showDepth(); });
  statSel.addEventListener("change", showDepth);
  await showRun();
  document.body.setAttribute("data-ready", "1");
  performance.mark("sowtel-ready");  // the first-paint benchmark reads it
}
