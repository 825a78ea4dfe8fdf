// sowtel's TensorBoard page: every site of a run at a glance, then the depth picture of a
// scanned or numbered site and the per-step chart of every other one.
// Plain ES module, no build step and no network beyond this TensorBoard's own routes.
//
// The view (run, compared run, site, mode, statistic, smoothing, layer) lives in TensorBoard's
// address after `#sowtel`, as `#sowtel&run=...&site=...`, so a view can be shared or reloaded.

import {
  el, fmt, label, lineChart, heatmap, sparkline, miniHeatmap, xAxis, chooseScale,
  lineColour, RUN_COLOURS, MAGENTA, LEFT,
} from "./charts.js";

const WORDS = { primal: "activation", cotangent: "gradient" };
const STATE_KEYS = ["run", "cmp", "site", "mode", "stat", "smooth", "layer"];
// Cards of plain sites drawn at most (each one request); the overview lists every site.
const MOST_CARDS = 60;

async function getJSON(path) {
  const response = await fetch(path);
  let body;
  try {
    body = await response.json();
  } catch (e) {
    throw new Error(`${path.split("?")[0]}: ${response.status} ${response.statusText}`);
  }
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function single(site, mode) {
  const stats = (site && site.stats_by_mode && site.stats_by_mode[mode]) || [];
  return stats.length === 1 && stats[0] === "mean";
}

// A mode with the word ML engineers use for it; a site that is one number (a loss) has a
// value, not an activation.
function modeLabel(mode, site) {
  if (mode === "value") return "logged";
  if (mode === "primal" && single(site, mode)) return "value";
  return WORDS[mode] ? `${WORDS[mode]} (${mode})` : mode;
}

function statLabel(site, mode, stat) {
  const stats = (site && site.stats_by_mode && site.stats_by_mode[mode]) || [];
  if (stat === "value" || (stat === "mean" && stats.length === 1)) return "value";
  return stat === "max_abs" ? "max |x|" : stat === "l2" ? "l2 norm" : stat;
}

// The statistic shown for a site when the page asks for `wanted` ("auto": a value's spread,
// a derivative's norm, a number itself), as the server's overview chooses it.
function statFor(site, mode, wanted) {
  const stats = (site.stats_by_mode && site.stats_by_mode[mode]) || site.stats;
  if (wanted && wanted !== "auto" && stats.includes(wanted)) return wanted;
  const prefs = mode === "value" ? ["value"] : mode === "primal" ? ["std", "mean"]
    : ["l2", "std", "mean"];
  const plain = stats.filter((k) => !["nan", "posinf", "neginf", "size"].includes(k));
  return prefs.find((k) => plain.includes(k)) || plain.sort()[0] || null;
}

// -- the view in the address ------------------------------------------------------------------

function hashHost() {
  try {
    return window.parent && window.parent !== window ? window.parent : window;
  } catch (e) {
    return window;
  }
}

function readState() {
  const state = {};
  let hash = "";
  try {
    hash = hashHost().location.hash;
  } catch (e) {
    hash = window.location.hash;
  }
  for (const part of hash.replace(/^#/, "").split("&")) {
    const eq = part.indexOf("=");
    if (eq < 0) continue;
    const key = decodeURIComponent(part.slice(0, eq));
    if (STATE_KEYS.includes(key)) state[key] = decodeURIComponent(part.slice(eq + 1));
  }
  return state;
}

function writeState(state) {
  const host = hashHost();
  let parts;
  try {
    parts = host.location.hash.replace(/^#/, "").split("&").filter((p) => p &&
      !STATE_KEYS.includes(decodeURIComponent(p.split("=")[0])));
  } catch (e) {
    return;
  }
  if (!parts.length) parts = ["sowtel"];
  for (const key of STATE_KEYS) {
    const v = state[key];
    if (v !== null && v !== undefined && v !== "") {
      parts.push(`${encodeURIComponent(key)}=${encodeURIComponent(v)}`);
    }
  }
  try {
    host.history.replaceState(host.history.state, "", `#${parts.join("&")}`);
  } catch (e) {
    // A page that does not let the frame change its address keeps working without it.
  }
}

// -- panels -----------------------------------------------------------------------------------

function alertList(health) {
  // The alert rules' alerts (enable(alerts=...)), each line as the exporter wrote it.
  const alerts = health.alerts || [];
  const box = el("div", { class: "alerts", id: "alerts" });
  if (!alerts.length) return box;
  const total = health.alerts_total || alerts.length;
  box.append(el("div", { class: "first" }, `${total} alert(s) of the alert rules`));
  const list = el("ul");
  for (const a of alerts) list.append(el("li", {}, a.text));
  if (total > alerts.length) list.append(el("li", {}, `and ${total - alerts.length} more`));
  box.append(list);
  return box;
}

function healthPanel(health, runName) {
  const panel = el("div", { class: "health", id: "health" });
  if (!health.first) {
    panel.classList.add(health.alerts && health.alerts.length ? "warn" : "ok");
    panel.append(`No NaN or infinity recorded in run ${runName}.`);
    panel.append(alertList(health));
    return panel;
  }
  const f = health.first;
  const where = f.site
    ? `site ${f.site}, ${modeLabel(f.mode)}, step ${f.step}` +
      (f.index !== null && f.index !== undefined ? `, index ${label(f.index)}` : "")
    : f.text;
  panel.append(el("div", { class: "first" }, `First non-finite value: ${where}`));
  const list = el("ul");
  for (const s of health.sites.slice(0, 20)) {
    list.append(el("li", {}, `${s.site}, ${modeLabel(s.mode)}: from step ${s.first_step}, ` +
                               `${s.steps} step(s)`));
  }
  if (health.sites.length > 20) list.append(el("li", {}, `and ${health.sites.length - 20} more`));
  panel.append(list);
  panel.append(alertList(health));
  return panel;
}

function lastText(row) {
  if (!row || !row.last) return "n/a";
  const l = row.last;
  if ("value" in l) return fmt(l.value, 4);
  if (l.min === null) return "n/a";
  return l.min === l.max ? fmt(l.min, 4) : `${fmt(l.min)} … ${fmt(l.max)}`;
}

function overviewTable(rows, other, sites, state, onPick) {
  const cmp = !!other;
  const table = el("table", { class: "overview", id: "overview-table" });
  table.append(el("thead", {}, el("tr", {},
    el("th", {}, "site"), el("th", {}, "mode"), el("th", {}, "statistic"),
    el("th", {}, cmp ? `last: ${state.run}` : "last value"),
    ...(cmp ? [el("th", {}, `last: ${state.cmp}`)] : []),
    el("th", {}, "over the steps"), el("th", {}, "non-finite"))));
  const body = el("tbody");
  const byKey = new Map((other || []).map((r) => [`${r.site}\u0000${r.mode}`, r]));
  for (const row of rows) {
    const site = sites.get(row.site);
    const twin = byKey.get(`${row.site}\u0000${row.mode}`);
    const depth = row.kind === "scan" || row.kind === "repeat";
    let chart;
    if (depth && row.spark && row.spark.index) {
      chart = miniHeatmap(row.spark);
    } else {
      const series = [];
      if (row.spark) series.push({ ...row.spark, colour: RUN_COLOURS[0] });
      if (twin && twin.spark && !twin.spark.index) {
        series.push({ ...twin.spark, colour: RUN_COLOURS[1], dash: "3,2" });
      }
      chart = sparkline(series);
    }
    const bad = row.nonfinite;
    const tr = el("tr", {
      "data-site": row.site, "data-mode": row.mode, "data-kind": row.kind,
      class: [bad ? "bad" : "", state.site === row.site && state.mode === row.mode
        ? "selected" : ""].join(" ").trim(),
      onclick: () => onPick(row),
    },
    el("td", { class: "site-name" }, row.site,
       depth && row.positions ? el("span", { class: "dim" },
                                   ` ${row.positions} ${row.kind === "scan" ? "layers" : "repeats"}`)
         : null),
    el("td", {}, modeLabel(row.mode, site)),
    el("td", {}, row.stat ? statLabel(site, row.mode, row.stat) : "n/a"),
    el("td", { class: "num" }, lastText(row)),
    ...(cmp ? [el("td", { class: "num" }, twin ? lastText(twin) : "not in this run")] : []),
    el("td", {}, chart),
    el("td", { class: bad ? "nonfinite" : "dim" },
       bad ? `from step ${bad.first_step}` + (bad.first_index !== null &&
               bad.first_index !== undefined ? ` (index ${label(bad.first_index)})` : "") +
             `, ${bad.steps} step(s)` : "none"));
    body.append(tr);
  }
  table.append(body);
  return table;
}

function legend(index, highlight, onPick, colours) {
  const box = el("div", { class: "legend", id: "legend" });
  box.append(el("span", { class: "legend-title" }, "layer:"));
  index.forEach((ix, j) => {
    const on = highlight === null || highlight === j;
    box.append(el("span", {
      class: `key${highlight === j ? " picked" : ""}`, "data-layer": String(j),
      style: `opacity:${on ? 1 : 0.45}`, onclick: () => onPick(j),
      title: `highlight layer ${label(ix)}`,
    }, el("i", { style: `background:${colours[j]}` }), label(ix)));
  });
  if (highlight !== null) {
    box.append(el("span", { class: "key clear", onclick: () => onPick(null) }, "show all"));
  }
  return box;
}

const STYLE = `
body { font-family: Roboto, sans-serif; margin: 16px 20px; color: #212121; font-size: 14px; }
h1 { font-size: 20px; margin: 0 0 10px; font-weight: 500; }
h2 { font-size: 16px; margin: 22px 0 8px; font-weight: 500; }
.controls { display: flex; flex-wrap: wrap; gap: 8px 18px; align-items: center;
            margin-bottom: 10px; font-size: 13px; }
.controls select { font-size: 13px; padding: 2px; }
.health { padding: 8px 12px; border-radius: 4px; background: #fde7ef; margin-bottom: 12px; }
.health.ok { background: #e8f5e9; }
.health.warn { background: #fff4e0; }
.health .alerts { margin-top: 6px; }
.health .first { font-weight: 600; }
.health ul { margin: 4px 0 0; padding-left: 20px; }
table.overview { border-collapse: collapse; font-size: 13px; }
table.overview th { text-align: left; font-weight: 500; color: #555; padding: 4px 10px;
                    border-bottom: 1px solid #ccc; }
table.overview td { padding: 3px 10px; border-bottom: 1px solid #eee; vertical-align: middle; }
table.overview tr { cursor: pointer; }
table.overview tbody tr:hover { background: #f3f6fb; }
table.overview tr.selected { background: #e3ecfa; }
table.overview tr.bad td.site-name { color: ${MAGENTA}; font-weight: 600; }
td.num { font-variant-numeric: tabular-nums; text-align: right; white-space: nowrap; }
td.nonfinite { color: ${MAGENTA}; }
.dim { color: #777; }
.tooltip { position: absolute; display: none; background: #333; color: #fff; font-size: 12px;
           padding: 4px 7px; border-radius: 3px; pointer-events: none; z-index: 10; }
.legend { font-size: 13px; margin: 6px 0 0 ${LEFT}px; display: flex; flex-wrap: wrap;
          gap: 3px 12px; max-width: 1100px; }
.legend .key { cursor: pointer; white-space: nowrap; user-select: none; }
.legend .key i { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
                 vertical-align: -1px; border-radius: 2px; }
.legend .key.picked { font-weight: 700; text-decoration: underline; }
.legend .legend-title { color: #555; }
.legend .clear { color: #1a73e8; }
svg text.tick { font-size: 12px; fill: #444; }
svg text.axis-label { font-size: 13px; fill: #222; }
svg.chart { display: block; }
svg.lines path.layer { cursor: pointer; }
.cards { display: flex; flex-wrap: wrap; gap: 14px; }
.card { border: 1px solid #e0e0e0; border-radius: 4px; padding: 8px 4px 4px; }
.card.selected { border-color: #1a73e8; box-shadow: 0 0 0 2px #c6dafc; }
.card .title { font-size: 14px; margin: 0 0 4px 10px; }
.caption { font-size: 13px; color: #444; margin: 6px 0 2px ${LEFT}px; }
.error { color: #b00020; }
.note { font-size: 12px; color: #555; margin: 4px 0 0 ${LEFT}px; }
.runs-key { font-size: 12px; margin-left: 10px; }
.runs-key b { display: inline-block; width: 18px; height: 0; border-top: 2px solid;
              vertical-align: middle; margin: 0 4px 0 8px; }
`;

// -- the page ---------------------------------------------------------------------------------

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
  const state = { stat: "auto", smooth: "0.6", layer: null, ...readState() };
  if (!runs.includes(state.run)) state.run = runs[0];
  if (state.cmp && (!runs.includes(state.cmp) || state.cmp === state.run)) state.cmp = null;

  const runSel = el("select", { id: "run" }, ...runs.map((r) => el("option", { value: r }, r)));
  const cmpSel = el("select", { id: "compare" }, el("option", { value: "" }, "none"),
                    ...runs.map((r) => el("option", { value: r }, r)));
  const statSel = el("select", { id: "stat" });
  const smoothIn = el("input", { id: "smoothing", type: "range", min: "0", max: "0.99",
                                 step: "0.01", style: "width:120px;vertical-align:middle" });
  const smoothOut = el("span", { class: "dim" });
  runSel.value = state.run;
  cmpSel.value = state.cmp || "";
  smoothIn.value = state.smooth;
  smoothOut.textContent = Number(state.smooth).toFixed(2);
  const healthBox = el("div");
  const overviewBox = el("div", { id: "overview" });
  const depthBox = el("div", { id: "depth" });
  const cardsBox = el("div", { id: "cards" });
  root.append(
    el("h1", {}, "Training health: every sown site"),
    el("div", { class: "controls" },
       el("label", {}, "run ", runSel), el("label", {}, "compare with ", cmpSel),
       el("label", {}, "statistic ", statSel),
       el("label", {}, "smoothing ", smoothIn, " ", smoothOut)),
    healthBox, overviewBox, depthBox, cardsBox);

  let view = null;  // what the current run(s) hold: sites, rows, depth choices
  let painted = false;  // the health panel and the depth picture drawn once
  const width = () => Math.max(760, Math.min(1240, root.clientWidth || 1200));
  const smoothing = () => Number(state.smooth) || 0;

  function save() {
    writeState({ ...state, stat: state.stat === "auto" ? null : state.stat,
                 smooth: state.smooth === "0.6" ? null : state.smooth,
                 layer: state.layer === null ? null : String(state.layer) });
  }

  // What the page needs before it draws anything: the run's sites and health (quick); the
  // overview, the depth picture and the cards then load side by side.
  async function load() {
    const run = state.run, cmp = state.cmp;
    const q = (r) => `run=${encodeURIComponent(r)}`;
    const [sites, health, cmpSites] = await Promise.all([
      getJSON(`sites?${q(run)}`), getJSON(`health?${q(run)}`),
      cmp ? getJSON(`sites?${q(cmp)}`) : null,
    ]);
    view = {
      sites: new Map(sites.sites.map((s) => [s.site, s])),
      order: sites.sites, health, rows: null, total: 0,
      cmpSites: cmpSites ? new Map(cmpSites.sites.map((s) => [s.site, s])) : null,
      cmpRows: null,
    };
    const stats = new Set();
    for (const s of sites.sites) for (const k of s.stats) stats.add(k);
    for (const k of ["size", "value"]) stats.delete(k);
    statSel.replaceChildren(
      el("option", { value: "auto" }, "auto: std of values, l2 of gradients"),
      ...[...stats].sort().map((k) => el("option", { value: k }, statLabel(null, "", k))));
    statSel.value = stats.has(state.stat) ? state.stat : "auto";
  }

  async function loadOverview() {
    const q = (r) => `run=${encodeURIComponent(r)}`;
    const statQ = state.stat && state.stat !== "auto" ? `&stat=${encodeURIComponent(state.stat)}`
      : "";
    try {
      const [overview, other] = await Promise.all([
        getJSON(`overview?${q(state.run)}${statQ}`),
        state.cmp ? getJSON(`overview?${q(state.cmp)}${statQ}`) : null,
      ]);
      view.rows = overview.rows;
      view.total = overview.total;
      view.cmpRows = other ? other.rows : null;
      drawOverview();
    } catch (e) {
      overviewBox.replaceChildren(el("div", { class: "error" }, e.message));
    }
  }

  function drawOverview() {
    const shown = view.rows.length < view.total
      ? ` (the first ${view.rows.length} of ${view.total} rows)` : "";
    overviewBox.replaceChildren(
      el("h2", {}, `Every site, in program order${shown}`),
      overviewTable(view.rows, view.cmpRows, view.sites, state, pick));
  }

  function pick(row) {
    state.site = row.site;
    state.mode = row.mode;
    state.layer = null;
    save();
    for (const tr of overviewBox.querySelectorAll("tbody tr")) {
      tr.classList.toggle("selected", tr.dataset.site === row.site &&
                                      tr.dataset.mode === row.mode);
    }
    if (row.kind === "scan" || row.kind === "repeat") {
      drawDepth().then(() => depthBox.scrollIntoView({ behavior: "smooth" }));
    } else {
      const card = cardsBox.querySelector(
        `.card[data-site="${CSS.escape(row.site)}"][data-mode="${CSS.escape(row.mode)}"]`);
      for (const c of cardsBox.querySelectorAll(".card")) c.classList.toggle("selected", c === card);
      if (card) card.scrollIntoView({ behavior: "smooth", block: "center" });
    }
  }

  // -- the depth section: one scanned or repeated site, layers x steps ------------------------

  function depthChoice() {
    const depthSites = view.order.filter((s) => s.kind === "scan" || s.kind === "repeat");
    if (!depthSites.length) return null;
    let site = depthSites.find((s) => s.site === state.site);
    if (!site) {
      const f = view.health.first;
      site = (f && depthSites.find((s) => s.site === f.site)) || depthSites[0];
    }
    let mode = site.modes.includes(state.mode) ? state.mode : null;
    if (!mode) {
      const f = view.health.first;
      mode = f && f.site === site.site && site.modes.includes(f.mode) ? f.mode : site.modes[0];
    }
    return { site, mode, depthSites };
  }

  async function drawDepth() {
    const choice = depthChoice();
    if (!choice) {
      depthBox.replaceChildren();
      return;
    }
    const { site, mode, depthSites } = choice;
    const stat = statFor(site, mode, state.stat);
    const siteSel = el("select", { id: "site" },
                       ...depthSites.map((s) => el("option", { value: s.site }, s.site)));
    siteSel.value = site.site;
    const modeSel = el("select", { id: "mode" },
                       ...site.modes.map((m) => el("option", { value: m }, modeLabel(m))));
    modeSel.value = mode;
    siteSel.addEventListener("change", () => {
      state.site = siteSel.value; state.mode = null; state.layer = null; save(); drawDepth();
    });
    modeSel.addEventListener("change", () => {
      state.mode = modeSel.value; state.layer = null; save(); drawDepth();
    });
    const status = el("div", { class: "note", id: "status" }, "loading…");
    depthBox.replaceChildren(
      el("h2", {}, "Layers × steps"),
      el("div", { class: "controls" }, el("label", {}, "site ", siteSel),
         el("label", {}, "mode ", modeSel),
         el("span", { class: "dim" }, `statistic: ${statLabel(site, mode, stat)}`)),
      status);
    const q = (r) => new URLSearchParams({ run: r, site: site.site, mode, stat });
    const cmpSite = view.cmpSites && view.cmpSites.get(site.site);
    const cmpHas = cmpSite && cmpSite.modes.includes(mode) &&
      (cmpSite.stats_by_mode[mode] || []).includes(stat);
    let data, other = null;
    try {
      [data, other] = await Promise.all([getJSON(`depth?${q(state.run)}`),
                                         cmpHas ? getJSON(`depth?${q(state.cmp)}`) : null]);
    } catch (e) {
      status.replaceChildren(el("span", { class: "error" }, e.message));
      return;
    }
    const w = width();
    const x = xAxis([...data.steps, ...(other ? other.steps : [])], w);
    const scale = chooseScale([...data.values, ...(other ? other.values : [])], false, true);
    const index = data.index;
    let highlight = state.layer === null || state.layer === undefined ? null
      : Number(state.layer);
    if (!(highlight >= 0 && highlight < index.length)) highlight = null;
    const word = site.kind === "repeat" ? "repeat" : "layer";
    const colours = index.map((_, j) => lineColour(j, index.length));
    const parts = [];
    let linesChart = null;
    const onHover = (step) => { if (linesChart) linesChart.guide(step); };
    const setLayer = (j) => {
      state.layer = j === null || j === highlight ? null : j;
      save();
      drawDepth();
    };
    const paging = data.positions > data.index.length
      ? `; the first ${data.index.length} of ${data.positions} positions` : "";
    status.textContent = `${data.index.length} ${word}s × ${data.steps.length} steps` +
      (data.downsampled ? " (a sample of the steps)" : "") + paging +
      (state.cmp && !cmpHas ? `; run ${state.cmp} has no ${site.site} (${mode}) ${stat}` : "");
    const mapOf = (d, name) => heatmap(d, {
      x, scale, stat: statLabel(site, mode, stat), label: word, tooltip, onHover,
      onPick: setLayer, highlight,
    }).canvas;
    if (other) parts.push(el("div", { class: "caption" }, `run ${state.run}`));
    parts.push(mapOf(data));
    if (other) {
      parts.push(el("div", { class: "caption" }, `run ${state.cmp}`), mapOf(other));
    }
    parts.push(el("div", { class: "note" }, "Grey: the " + word + " did not run that step. " +
                  "Magenta: NaN or infinity in its value. " + (scale.clipped
                  ? "Colours span the 5th to 95th percentile; values beyond take the end " +
                    "colours. " : "") + "Click a row to highlight its " + word + " below."));
    const series = [];
    const add = (d, dash, run) => {
      d.index.forEach((ix, j) => {
        const jj = index.findIndex((v) => label(v) === label(ix));
        const key = jj < 0 ? j : jj;
        series.push({ key, label: `${run ? run + ", " : ""}${word} ${label(ix)}`,
                      steps: d.steps, values: d.steps.map((_, i) => d.values[i][j]),
                      bad: d.steps.map((_, i) => d.nonfinite[i][j]),
                      colour: colours[key] || "#999", dash });
      });
    };
    add(data, null, other ? state.run : "");
    if (other) add(other, "5,3", state.cmp);
    linesChart = lineChart(series, {
      x, height: 300, yLabel: statLabel(site, mode, stat), smoothing: smoothing(),
      highlight, tooltip, onPick: (key) => setLayer(Number(key)),
    });
    parts.push(el("h2", {}, `One line per ${word}`), linesChart.svg,
               legend(index, highlight, setLayer, colours));
    if (other) {
      parts.push(el("div", { class: "note" }, `solid: run ${state.run}; dashed: run ` +
                    `${state.cmp}`));
    }
    depthBox.append(...parts);
  }

  // -- the cards: every plain site's per-step chart -----------------------------------------

  async function drawCards() {
    const plain = [];
    for (const s of view.order) {
      if (s.kind !== "plain" && s.kind !== "logged") continue;
      for (const m of s.modes) plain.push([s, m]);
    }
    if (!plain.length) {
      cardsBox.replaceChildren();
      return;
    }
    const w = width();
    const cardW = w >= 1100 ? Math.floor((w - 40) / 2) : w - 20;
    const grid = el("div", { class: "cards" });
    const more = plain.length > MOST_CARDS
      ? ` (the first ${MOST_CARDS} of ${plain.length})` : "";
    cardsBox.replaceChildren(el("h2", {}, `Per-step charts${more}`), grid);
    const jobs = [];
    for (const [site, mode] of plain.slice(0, MOST_CARDS)) {
      const stat = statFor(site, mode, state.stat);
      const card = el("div", {
        class: `card${state.site === site.site && state.mode === mode ? " selected" : ""}`,
        "data-site": site.site, "data-mode": mode, style: `width:${cardW}px`,
      }, el("div", { class: "title" }, el("b", {}, site.site),
            mode === "value" ? " (logged)" : single(site, mode) ? " (value)"
              : ` · ${modeLabel(mode)} · ${statLabel(site, mode, stat)}`));
      grid.append(card);
      jobs.push(async () => {
        const q = (r) => new URLSearchParams({ run: r, site: site.site, mode, stat });
        const twin = view.cmpSites && view.cmpSites.get(site.site);
        const cmpHas = twin && twin.modes.includes(mode) &&
          (twin.stats_by_mode[mode] || []).includes(stat);
        try {
          const [a, b] = await Promise.all([getJSON(`series?${q(state.run)}`),
                                            cmpHas ? getJSON(`series?${q(state.cmp)}`) : null]);
          const x = xAxis([...a.steps, ...(b ? b.steps : [])], cardW - 8, 24);
          const series = [{ label: state.cmp ? state.run : "", steps: a.steps,
                            values: a.values, bad: a.nonfinite, colour: RUN_COLOURS[0] }];
          if (b) {
            series.push({ label: state.cmp, steps: b.steps, values: b.values,
                          bad: b.nonfinite, colour: RUN_COLOURS[1], dash: "5,3" });
          }
          const chart = lineChart(series, { x, height: 220, smoothing: smoothing(), tooltip,
                                            yLabel: statLabel(site, mode, stat) });
          card.append(chart.svg);
          const bad = a.nonfinite.map((c, i) => (c > 0 ? a.steps[i] : null))
            .filter((s) => s !== null);
          if (bad.length) {
            card.append(el("div", { class: "note nonfinite" },
                           `NaN or infinity at ${bad.length} step(s), from step ${bad[0]}`));
          }
          if (state.cmp) {
            card.append(el("div", { class: "runs-key" },
                           el("b", { style: `border-color:${RUN_COLOURS[0]}` }), state.run,
                           el("b", { style: `border-color:${RUN_COLOURS[1]};border-top-style:dashed` }),
                           cmpHas ? state.cmp : `${state.cmp} (not recorded there)`));
          }
        } catch (e) {
          card.append(el("div", { class: "error" }, e.message));
        }
      });
    }
    // A few requests at a time: TensorBoard serves them one by one anyway.
    const queue = jobs.slice();
    await Promise.all([0, 1, 2].map(async () => {
      while (queue.length) await queue.shift()();
    }));
  }

  async function showAll() {
    document.body.removeAttribute("data-ready");
    try {
      await load();
    } catch (e) {
      overviewBox.replaceChildren(el("div", { class: "error" }, e.message));
      return;
    }
    healthBox.replaceChildren(healthPanel(view.health, state.run));
    // The depth picture first: TensorBoard answers one request at a time in effect (one
    // Python process), and the overview reads every site. Then the rest, side by side.
    overviewBox.replaceChildren(el("h2", {}, "Every site, in program order"),
                                el("div", { class: "note", style: "margin-left:0" }, "loading…"));
    await drawDepth();
    if (!painted) {
      painted = true;
      performance.mark("sowtel-ready");  // the first-paint benchmark reads it
    }
    await Promise.all([loadOverview(), drawCards()]);
    document.body.setAttribute("data-ready", "1");
  }

  runSel.addEventListener("change", () => {
    state.run = runSel.value;
    if (state.cmp === state.run) { state.cmp = null; cmpSel.value = ""; }
    save();
    showAll();
  });
  cmpSel.addEventListener("change", () => {
    state.cmp = cmpSel.value && cmpSel.value !== state.run ? cmpSel.value : null;
    cmpSel.value = state.cmp || "";
    save();
    showAll();
  });
  statSel.addEventListener("change", () => { state.stat = statSel.value; save(); showAll(); });
  smoothIn.addEventListener("input", () => {
    smoothOut.textContent = Number(smoothIn.value).toFixed(2);
  });
  smoothIn.addEventListener("change", () => {
    state.smooth = smoothIn.value;
    save();
    drawDepth();
    drawCards();
  });
  await showAll();
  save();
}
