// Two runs side by side (the run_compare tool): the A/B view for proving a change helped.
import { tool } from "./api.js";
import { fail, h } from "./dom.js";

const ROWS = [["state", "state"], ["lane", "lane"], ["tasks", "tasks"], ["model calls", "model_calls"],
  ["tokens", "tokens"], ["wall ms", "wall_ms"], ["escalations", "escalations"],
  ["verdicts passed", "verdicts_ok"], ["verdicts failed", "verdicts_failed"], ["request", "request"], ["answer", "answer"]];

export async function comparePage(main, a = "", b = "") {
  const ia = h("input", { id: "compare-a", placeholder: "run A", value: a });
  const ib = h("input", { id: "compare-b", placeholder: "run B", value: b });
  const out = h("div");
  const go = h("button", { onclick: () => { location.hash = `#/compare/${encodeURIComponent(ia.value)}/${encodeURIComponent(ib.value)}`; } }, "Compare");
  main.append(h("h1", {}, "Compare"), h("div", { class: "filters" }, ia, ib, go), out);
  if (!a || !b) return;
  try {
    const c = await tool("run_compare", { a, b });
    out.append(h("table", { id: "compare" },
      h("thead", {}, h("tr", {}, h("th", {}, ""), h("th", {}, c.a.id), h("th", {}, c.b.id))),
      h("tbody", {}, ROWS.map(([label, key]) => h("tr", {}, h("th", {}, label),
        h("td", {}, h("pre", {}, String(c.a[key] ?? ""))), h("td", {}, h("pre", {}, String(c.b[key] ?? ""))))))));
  } catch (err) {
    fail(out, err);
  }
}
