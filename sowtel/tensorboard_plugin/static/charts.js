// Charts of sowtel's TensorBoard page: line charts, a heatmap, sparklines, their axes and
// colour scales. Plain ES module, no build step, no library.
//
// A chart's x axis is the training step, the same for every chart of a section (`xAxis`), so
// a heatmap and the line chart under it line up step for step. A y (or colour) scale is
// logarithmic only when the data are all positive and span more than a decade (`chooseScale`).

const SVG = "http://www.w3.org/2000/svg";
export const GREY = "#d6d6d6";
export const MAGENTA = "#e0006c";
// Room left of a plot for the y labels, and right of it for a colour bar or nothing.
export const LEFT = 76;
export const RIGHT = 120;

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    if (k === "style") node.style.cssText = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function svgEl(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- numbers ----------------------------------------------------------------------------------

export function fmt(v, digits = 3) {
  if (v === null || v === undefined || !Number.isFinite(v)) return "n/a";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) {
    return v.toExponential(digits - 1).replace(/\.?0+e/, "e").replace("e+", "e");
  }
  if (Number.isInteger(v) && a < 1e5) return String(v);
  return Number(v.toPrecision(digits)).toString();
}

// Tick values covering [lo, hi]: about n of them at 1, 2 or 5 times a power of ten.
export function niceTicks(lo, hi, n = 5) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / Math.max(n, 1);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const r = raw / mag;
  const step = (r >= 7.07 ? 10 : r >= 3.16 ? 5 : r >= 1.41 ? 2 : 1) * mag;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
    ticks.push(Math.abs(t) < step * 1e-9 ? 0 : Number(t.toPrecision(12)));
  }
  return ticks;
}

// The scale of a set of values: logarithmic when every finite value is positive and they
// span more than a decade (a 0.67-0.95 range stays linear), else linear. With `robust`, the
// range is the 5th to 95th percentile of many values (as TensorBoard ignores outliers), so the
// first steps' large gradients do not wash out a heatmap's colours (values beyond the range
// take the end colours).
export function chooseScale(arrays, forceLinear = false, robust = false) {
  let lo = Infinity, hi = -Infinity, positive = true;
  const all = [];
  for (const arr of arrays) for (const v of arr) {
    if (v === null || v === undefined || !Number.isFinite(v)) continue;
    if (v <= 0) positive = false;
    if (v < lo) lo = v;
    if (v > hi) hi = v;
    if (robust) all.push(v);
  }
  if (lo === Infinity) return { log: false, lo: 0, hi: 1, empty: true };
  let clipped = false;
  if (robust && all.length >= 200) {
    all.sort((a, b) => a - b);
    const qlo = all[Math.floor(0.05 * (all.length - 1))];
    const qhi = all[Math.ceil(0.95 * (all.length - 1))];
    if (qhi > qlo) {
      clipped = qlo > lo || qhi < hi;
      lo = qlo;
      hi = qhi;
    }
  }
  const log = !forceLinear && positive && hi / lo > 10;
  if (log) return { log, lo: Math.log10(lo), hi: Math.log10(hi), clipped };
  if (hi === lo) {
    const pad = Math.abs(hi) * 0.05 || 0.5;
    return { log, lo: lo - pad, hi: hi + pad, clipped };
  }
  return { log, lo, hi, clipped };
}

// Where a value falls in its scale, from 0 (lo) to 1 (hi); null if it has no place there.
export function position(scale, v) {
  if (v === null || v === undefined || !Number.isFinite(v)) return null;
  if (scale.log) {
    if (!(v > 0)) return null;
    return (Math.log10(v) - scale.lo) / (scale.hi - scale.lo || 1);
  }
  return (v - scale.lo) / (scale.hi - scale.lo || 1);
}

// Ticks of a scale, as [value, place 0..1]: decades on a log scale (and 2 and 5 between them
// when there are few decades), 1-2-5 steps on a linear one.
export function scaleTicks(scale, n = 5) {
  if (!scale.log) return niceTicks(scale.lo, scale.hi, n).map((t) => [t, position(scale, t)]);
  const out = [];
  const decades = scale.hi - scale.lo;
  const mults = decades < 2 ? [1, 2, 5] : decades < 6 ? [1] : null;
  const every = mults ? 1 : Math.ceil(decades / 6);
  for (let e = Math.floor(scale.lo); e <= Math.ceil(scale.hi); e++) {
    if (!mults && e % every !== 0) continue;
    for (const m of mults || [1]) {
      const v = m * Math.pow(10, e);
      const p = position(scale, v);
      if (p >= -1e-9 && p <= 1 + 1e-9) out.push([v, p]);
    }
  }
  if (out.length < 2) {
    return [[Math.pow(10, scale.lo), 0], [Math.pow(10, scale.hi), 1]];
  }
  return out;
}

// Series shorter than this are drawn as they are: an average over a few points hides them.
export const SMOOTH_FROM = 20;

// TensorBoard's smoothing: an exponential moving average over the points, debiased so the
// first points are not pulled towards zero; non-finite points are left as they are.
export function smooth(values, weight) {
  if (!(weight > 0) || values.length < SMOOTH_FROM) return values;
  const finite = values.filter((v) => v !== null && Number.isFinite(v));
  if (finite.every((v) => v === finite[0])) return values;
  let last = 0, n = 0;
  return values.map((v) => {
    if (v === null || !Number.isFinite(v)) return v;
    last = last * weight + (1 - weight) * v;
    n += 1;
    return last / (1 - Math.pow(weight, n));
  });
}

// -- colours ----------------------------------------------------------------------------------

// A perceptual ramp from dark blue through teal to yellow (viridis-like).
const RAMP = [[68, 1, 84], [65, 68, 135], [42, 120, 142], [34, 168, 132], [122, 209, 81],
              [253, 231, 37]];
export function ramp(t) {
  if (!(t >= 0)) t = 0;
  if (t > 1) t = 1;
  const x = t * (RAMP.length - 1);
  const i = Math.min(Math.floor(x), RAMP.length - 2);
  const f = x - i;
  const c = RAMP[i].map((a, k) => Math.round(a + (RAMP[i + 1][k] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// Distinct colours for up to ten lines; more lines are coloured by depth along a ramp (dark
// blue: the first layer, through purple and red to orange: the last; no pale end, which would
// vanish on white, and no yellow-green, which is the heatmap's), and the one selected in the
// legend is drawn on top.
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#17becf"];
const DEPTH = [[13, 8, 135], [106, 0, 168], [177, 42, 144], [225, 100, 98], [232, 150, 30]];
export function lineColour(j, n) {
  if (n <= PALETTE.length) return PALETTE[j % PALETTE.length];
  const t = n > 1 ? j / (n - 1) : 0;
  const x = t * (DEPTH.length - 1);
  const i = Math.min(Math.floor(x), DEPTH.length - 2);
  const f = x - i;
  const c = DEPTH[i].map((a, k) => Math.round(a + (DEPTH[i + 1][k] - a) * f));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}
export const RUN_COLOURS = ["#1f77b4", "#d95f02"];

// -- the shared x axis ------------------------------------------------------------------------

// The step axis of a section: plot from LEFT to width - right, for every chart in it.
export function xAxis(steps, width, right = RIGHT) {
  let lo = Infinity, hi = -Infinity;
  for (const s of steps) {
    if (s < lo) lo = s;
    if (s > hi) hi = s;
  }
  if (lo === Infinity) { lo = 0; hi = 1; }
  if (hi === lo) hi = lo + 1;
  const plotW = width - LEFT - right;
  return {
    lo, hi, width, plotW,
    px: (s) => LEFT + ((s - lo) / (hi - lo)) * plotW,
    step: (px) => lo + ((px - LEFT) / plotW) * (hi - lo),
    ticks: () => niceTicks(lo, hi, Math.max(2, Math.floor(plotW / 110)))
      .filter((t) => t >= lo && t <= hi && Number.isInteger(t)),
  };
}

function nearestIndex(steps, s) {
  let a = 0, b = steps.length - 1;
  if (b < 0) return -1;
  while (b - a > 1) {
    const m = (a + b) >> 1;
    if (steps[m] < s) a = m; else b = m;
  }
  return Math.abs(steps[a] - s) <= Math.abs(steps[b] - s) ? a : b;
}

function drawXAxis(svg, x, top, label) {
  const g = svgEl("g", { class: "x-axis" });
  g.append(svgEl("line", { x1: LEFT, x2: LEFT + x.plotW, y1: top, y2: top, stroke: "#888" }));
  for (const t of x.ticks()) {
    const px = x.px(t);
    g.append(svgEl("line", { x1: px, x2: px, y1: top, y2: top + 5, stroke: "#888" }));
    g.append(svgEl("text", { x: px, y: top + 18, "text-anchor": "middle", class: "tick" },
                   fmt(t, 4)));
  }
  if (label) {
    g.append(svgEl("text", { x: LEFT + x.plotW / 2, y: top + 36, "text-anchor": "middle",
                             class: "axis-label" }, label));
  }
  svg.append(g);
}

// -- line chart -------------------------------------------------------------------------------

// series: [{label, steps, values, colour, dash, key, bad (non-finite counts)}]; opts: {x, height, yLabel, smoothing,
// highlight (a key), onPick(key), tooltip (an element), linear}. Returns {svg, guide(step)}.
export function lineChart(series, opts) {
  const { x, height = 260, yLabel = "", smoothing = 0, tooltip } = opts;
  const top = 12, bottom = 44, plotH = height - top - bottom;
  const scale = chooseScale(series.map((s) => s.values), opts.linear);
  const svg = svgEl("svg", { width: x.width, height, class: "chart lines",
                             "data-scale": scale.log ? "log" : "linear" });
  const y = (v) => {
    const p = position(scale, v);
    return p === null ? null : top + plotH * (1 - p);
  };
  const grid = svgEl("g", { class: "y-axis" });
  for (const [v, p] of scaleTicks(scale, Math.max(3, Math.floor(plotH / 45)))) {
    const py = top + plotH * (1 - p);
    grid.append(svgEl("line", { x1: LEFT, x2: LEFT + x.plotW, y1: py, y2: py,
                                stroke: "#e6e6e6" }));
    grid.append(svgEl("text", { x: LEFT - 6, y: py + 4, "text-anchor": "end", class: "tick" },
                      fmt(v)));
  }
  const yText = yLabel + (scale.log ? " (log scale)" : "");
  grid.append(svgEl("text", { x: 14, y: top + plotH / 2, "text-anchor": "middle",
                              transform: `rotate(-90 14 ${top + plotH / 2})`,
                              class: "axis-label" }, yText));
  svg.append(grid);
  drawXAxis(svg, x, top + plotH, "training step");
  const lines = svgEl("g", { class: "series" });
  const drawn = [];
  const highlight = opts.highlight;
  const pathOf = (steps, values) => {
    let d = "", pen = false;
    for (let i = 0; i < steps.length; i++) {
      const py = y(values[i]);
      if (py === null) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${x.px(steps[i]).toFixed(1)},${py.toFixed(1)}`;
      pen = true;
    }
    return d;
  };
  // Dimmed lines first, the highlighted one last (on top).
  const order = series.map((s, i) => i).sort((a, b) =>
    (series[a].key === highlight) - (series[b].key === highlight));
  for (const i of order) {
    const s = series[i];
    const smoothed = smooth(s.values, smoothing);
    const on = highlight === undefined || highlight === null || s.key === highlight;
    const opacity = on ? 1 : 0.18;
    if (smoothed !== s.values) {
      lines.append(svgEl("path", { d: pathOf(s.steps, s.values), fill: "none",
                                   stroke: s.colour, "stroke-width": 1,
                                   "stroke-opacity": 0.3 * opacity, class: "raw" }));
    }
    const path = svgEl("path", {
      d: pathOf(s.steps, smoothed), fill: "none", stroke: s.colour,
      "stroke-width": on && highlight !== undefined && highlight !== null ? 2.6 : 1.6,
      "stroke-opacity": opacity, class: `line${s.key !== undefined ? " layer" : ""}`,
      "data-key": s.key === undefined ? "" : String(s.key),
    });
    if (s.dash) path.setAttribute("stroke-dasharray", s.dash);
    lines.append(path);
    drawn.push({ s, smoothed });
  }
  svg.append(lines);
  // Steps where a series held a NaN or infinity: a magenta mark on its line (on the top edge
  // where its statistic itself is not finite).
  for (const s of series) {
    if (!s.bad) continue;
    for (let i = 0; i < s.steps.length; i++) {
      if (!(s.bad[i] > 0)) continue;
      const py = y(s.values[i]);
      svg.append(svgEl("circle", { cx: x.px(s.steps[i]), cy: py === null ? top : py, r: 4,
                                   fill: MAGENTA, class: "nonfinite" }));
    }
  }
  const guide = svgEl("line", { y1: top, y2: top + plotH, stroke: "#555",
                                "stroke-dasharray": "3,3", visibility: "hidden" });
  const dot = svgEl("circle", { r: 4, fill: "#fff", "stroke-width": 2, visibility: "hidden" });
  svg.append(guide, dot);
  const setGuide = (step) => {
    if (step === null || step === undefined) {
      guide.setAttribute("visibility", "hidden");
      return;
    }
    guide.setAttribute("x1", x.px(step));
    guide.setAttribute("x2", x.px(step));
    guide.setAttribute("visibility", "visible");
  };
  const hide = () => {
    setGuide(null);
    dot.setAttribute("visibility", "hidden");
    if (tooltip) tooltip.style.display = "none";
    if (opts.onHover) opts.onHover(null);
  };
  svg.addEventListener("mousemove", (ev) => {
    const r = svg.getBoundingClientRect();
    const mx = ev.clientX - r.left, my = ev.clientY - r.top;
    if (mx < LEFT || mx > LEFT + x.plotW) { hide(); return; }
    const step = x.step(mx);
    // The line nearest the pointer at that step, and its value there.
    let best = null;
    for (const { s, smoothed } of drawn) {
      const i = nearestIndex(s.steps, step);
      if (i < 0) continue;
      const py = y(smoothed[i]);
      if (py === null) continue;
      const d = Math.abs(py - my) + (highlight !== undefined && highlight !== null &&
                                     s.key !== highlight ? 1e4 : 0);
      if (!best || d < best.d) best = { d, s, i, py, v: s.values[i], sm: smoothed[i] };
    }
    if (!best) { hide(); return; }
    const at = best.s.steps[best.i];
    setGuide(at);
    dot.setAttribute("cx", x.px(at));
    dot.setAttribute("cy", best.py);
    dot.setAttribute("stroke", best.s.colour);
    dot.setAttribute("visibility", "visible");
    if (tooltip) {
      tooltip.textContent = `step ${at}` + (best.s.label ? `, ${best.s.label}` : "") +
        `: ${fmt(best.v, 4)}` + (best.sm !== best.v ? ` (smoothed ${fmt(best.sm, 4)})` : "");
      tooltip.style.display = "block";
      tooltip.style.left = `${ev.pageX + 14}px`;
      tooltip.style.top = `${ev.pageY + 12}px`;
    }
    if (opts.onHover) opts.onHover(at);
  });
  svg.addEventListener("mouseleave", hide);
  if (opts.onPick) {
    svg.addEventListener("click", (ev) => {
      const key = ev.target && ev.target.getAttribute && ev.target.getAttribute("data-key");
      if (key) opts.onPick(key);
    });
  }
  return { svg, guide: setGuide, scale };
}

// -- heatmap ----------------------------------------------------------------------------------

function cellEdges(steps, x) {
  // Each step's cell spans half-way to its neighbours, so irregular steps keep their places.
  const edges = [];
  for (let i = 0; i <= steps.length; i++) {
    const a = i === 0 ? steps[0] - (steps.length > 1 ? (steps[1] - steps[0]) / 2 : 0.5)
      : i === steps.length
        ? steps[i - 1] + (steps.length > 1 ? (steps[i - 1] - steps[i - 2]) / 2 : 0.5)
        : (steps[i - 1] + steps[i]) / 2;
    edges.push(Math.max(LEFT, Math.min(LEFT + x.plotW, x.px(a))));
  }
  return edges;
}

// data: {steps, index, values, nonfinite}; opts: {x, scale (shared), stat, label, tooltip,
// onHover(step), onPick(j), highlight (j)}. Returns {canvas, height}.
export function heatmap(data, opts) {
  const { steps, index, values, nonfinite } = data;
  const { x, scale, tooltip } = opts;
  const rowH = Math.max(3, Math.min(18, Math.floor(380 / Math.max(index.length, 1))));
  const top = 8, plotH = rowH * index.length, height = top + plotH + 44;
  const canvas = el("canvas", { width: String(x.width), height: String(height),
                                class: "heatmap", "data-scale": scale.log ? "log" : "linear" });
  const ctx = canvas.getContext("2d");
  const edges = cellEdges(steps, x);
  const bad = [];
  for (let i = 0; i < steps.length; i++) {
    const x0 = Math.floor(edges[i]), x1 = Math.max(x0 + 1, Math.floor(edges[i + 1]));
    for (let j = 0; j < index.length; j++) {
      if (nonfinite && nonfinite[i] && nonfinite[i][j] > 0) bad.push([i, j]);
      const p = position(scale, values[i][j]);
      ctx.fillStyle = p === null ? GREY : ramp(p);
      ctx.fillRect(x0, top + j * rowH, x1 - x0, rowH);
    }
  }
  // NaN and infinities last, at least 3 pixels wide: one bad step among a thousand shows.
  ctx.fillStyle = MAGENTA;
  for (const [i, j] of bad) {
    const mid = (edges[i] + edges[i + 1]) / 2;
    const w = Math.max(3, edges[i + 1] - edges[i]);
    ctx.fillRect(Math.floor(mid - w / 2), top + j * rowH, Math.ceil(w), rowH);
  }
  if (opts.highlight !== null && opts.highlight !== undefined && opts.highlight < index.length) {
    ctx.strokeStyle = "#000";
    ctx.lineWidth = 1.5;
    ctx.strokeRect(LEFT - 1, top + opts.highlight * rowH, x.plotW + 2, rowH);
  }
  ctx.fillStyle = "#333";
  ctx.font = "12px Roboto, sans-serif";
  ctx.textAlign = "right";
  const every = Math.ceil(14 / rowH);
  for (let j = 0; j < index.length; j += every) {
    ctx.fillText(label(index[j]), LEFT - 6, top + j * rowH + rowH / 2 + 4);
  }
  ctx.save();
  ctx.translate(16, top + plotH / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "center";
  ctx.font = "13px Roboto, sans-serif";
  ctx.fillText(opts.label || "layer", 0, 0);
  ctx.restore();
  // The x axis, as the line chart draws it.
  ctx.strokeStyle = "#888";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(LEFT, top + plotH + 0.5);
  ctx.lineTo(LEFT + x.plotW, top + plotH + 0.5);
  ctx.stroke();
  ctx.textAlign = "center";
  ctx.font = "12px Roboto, sans-serif";
  for (const t of x.ticks()) {
    const px = Math.round(x.px(t)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(px, top + plotH);
    ctx.lineTo(px, top + plotH + 5);
    ctx.stroke();
    ctx.fillText(fmt(t, 4), px, top + plotH + 18);
  }
  ctx.font = "13px Roboto, sans-serif";
  ctx.fillText("training step", LEFT + x.plotW / 2, top + plotH + 36);
  colourBar(ctx, scale, LEFT + x.plotW + 18, top, Math.max(plotH, 60), opts.stat);
  const at = (ev) => {
    const r = canvas.getBoundingClientRect();
    const mx = ev.clientX - r.left, my = ev.clientY - r.top;
    const j = Math.floor((my - top) / rowH);
    if (mx < LEFT || mx > LEFT + x.plotW || j < 0 || j >= index.length) return null;
    const i = nearestIndex(steps, x.step(mx));
    return i < 0 ? null : { i, j };
  };
  canvas.addEventListener("mousemove", (ev) => {
    const cell = at(ev);
    if (!cell) {
      if (tooltip) tooltip.style.display = "none";
      if (opts.onHover) opts.onHover(null);
      return;
    }
    const { i, j } = cell;
    const v = values[i][j];
    const bad = nonfinite && nonfinite[i] && nonfinite[i][j] > 0
      ? `, ${nonfinite[i][j]} NaN or infinite` : "";
    if (tooltip) {
      tooltip.textContent = `step ${steps[i]}, ${opts.label || "layer"} ${label(index[j])}: ` +
        `${opts.stat} = ${v === null ? "n/a" : fmt(v, 4)}${bad}`;
      tooltip.style.display = "block";
      tooltip.style.left = `${ev.pageX + 14}px`;
      tooltip.style.top = `${ev.pageY + 12}px`;
    }
    if (opts.onHover) opts.onHover(steps[i]);
  });
  canvas.addEventListener("mouseleave", () => {
    if (tooltip) tooltip.style.display = "none";
    if (opts.onHover) opts.onHover(null);
  });
  if (opts.onPick) {
    canvas.addEventListener("click", (ev) => {
      const cell = at(ev);
      if (cell) opts.onPick(cell.j);
    });
  }
  return { canvas, height };
}

function colourBar(ctx, scale, bx, top, h, stat) {
  for (let yy = 0; yy < h; yy++) {
    ctx.fillStyle = ramp(1 - yy / Math.max(h - 1, 1));
    ctx.fillRect(bx, top + yy, 14, 1);
  }
  ctx.strokeStyle = "#888";
  ctx.strokeRect(bx - 0.5, top - 0.5, 15, h + 1);
  ctx.fillStyle = "#333";
  ctx.font = "12px Roboto, sans-serif";
  ctx.textAlign = "left";
  for (const [v, p] of scaleTicks(scale, Math.max(3, Math.floor(h / 40)))) {
    const py = top + (1 - p) * (h - 1);
    ctx.fillRect(bx + 14, Math.round(py), 4, 1);
    ctx.fillText(fmt(v), bx + 21, py + 4);
  }
  ctx.save();
  ctx.translate(bx + 88, top + h / 2);
  ctx.rotate(-Math.PI / 2);
  ctx.textAlign = "center";
  ctx.font = "12px Roboto, sans-serif";
  ctx.fillText(`${stat}${scale.log ? " (log scale)" : ""}`, 0, 0);
  ctx.restore();
}

export function label(index) {
  return Array.isArray(index) ? `[${index.join(",")}]` : String(index);
}

// -- small charts of the overview -------------------------------------------------------------

// A sparkline of one or two series (the second dashed), with a dot at each one's last point.
export function sparkline(series, width = 150, height = 30) {
  const svg = svgEl("svg", { width, height, class: "spark" });
  const all = series.flatMap((s) => s.steps);
  if (!all.length) return svg;
  const lo = Math.min(...all), hi = Math.max(...all);
  const scale = chooseScale(series.map((s) => s.values));
  const px = (s) => 2 + ((s - lo) / (hi - lo || 1)) * (width - 8);
  for (const s of series) {
    let d = "", pen = false, last = null;
    for (let i = 0; i < s.steps.length; i++) {
      const p = position(scale, s.values[i]);
      if (p === null) { pen = false; continue; }
      const py = 3 + (height - 6) * (1 - p);
      d += `${pen ? "L" : "M"}${px(s.steps[i]).toFixed(1)},${py.toFixed(1)}`;
      pen = true;
      last = [px(s.steps[i]), py];
    }
    const path = svgEl("path", { d, fill: "none", stroke: s.colour, "stroke-width": 1.4 });
    if (s.dash) path.setAttribute("stroke-dasharray", s.dash);
    svg.append(path);
    if (last) svg.append(svgEl("circle", { cx: last[0], cy: last[1], r: 2.2, fill: s.colour }));
  }
  return svg;
}

// A small layers x steps picture of a scanned site: its own colour scale, grey where a layer
// did not run.
export function miniHeatmap(spark, width = 150, height = 30) {
  const canvas = el("canvas", { width: String(width), height: String(height),
                                class: "spark-heatmap" });
  const ctx = canvas.getContext("2d");
  const { steps, values } = spark;
  const rows = spark.index.length;
  if (!steps.length || !rows) return canvas;
  const scale = chooseScale(values, false, true);
  const cw = width / steps.length, rh = height / rows;
  for (let i = 0; i < steps.length; i++) {
    for (let j = 0; j < rows; j++) {
      const p = position(scale, values[i][j]);
      ctx.fillStyle = p === null ? GREY : ramp(p);
      ctx.fillRect(Math.floor(i * cw), Math.floor(j * rh), Math.ceil(cw), Math.ceil(rh));
    }
  }
  return canvas;
}
