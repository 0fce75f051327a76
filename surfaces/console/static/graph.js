// The task DAG as SVG: columns by longest-path depth, one box per task, coloured by state.
import { h } from "./dom.js";

export function dag(tasks) {
  const byId = new Map(tasks.map((t) => [t.id, t]));
  const depth = new Map();
  const depthOf = (id, seen = new Set()) => {
    if (depth.has(id)) return depth.get(id);
    if (seen.has(id)) return 0;
    seen.add(id);
    const needs = (byId.get(id)?.needs || []).filter((n) => byId.has(n));
    const d = needs.length ? 1 + Math.max(...needs.map((n) => depthOf(n, seen))) : 0;
    depth.set(id, d);
    return d;
  };
  const columns = [];
  for (const t of tasks) (columns[depthOf(t.id)] ||= []).push(t);
  const W = 130, H = 30, GX = 50, GY = 12;
  const at = new Map();
  columns.forEach((col, x) => col.forEach((t, y) => at.set(t.id, { x: x * (W + GX) + 10, y: y * (H + GY) + 10 })));
  const width = columns.length * (W + GX) + 20;
  const height = Math.max(...columns.map((c) => c.length), 1) * (H + GY) + 20;
  const edges = [];
  for (const t of tasks) {
    for (const n of t.needs || []) {
      const a = at.get(n), b = at.get(t.id);
      if (a && b) edges.push(h("line", { class: "edge", x1: a.x + W, y1: a.y + H / 2, x2: b.x, y2: b.y + H / 2 }));
    }
  }
  const nodes = tasks.map((t) => {
    const p = at.get(t.id);
    return h("g", { class: `node state-${t.state}`, "data-task": t.id, transform: `translate(${p.x},${p.y})` },
      h("title", {}, `${t.id} (${t.lane}): ${t.state}`),
      h("rect", { width: W, height: H, rx: 5 }),
      h("text", { x: 8, y: 19 }, `${t.id.slice(0, 14)} · ${t.state}`));
  });
  return h("svg", { id: "dag", width, height, viewBox: `0 0 ${width} ${height}` }, edges, nodes);
}
