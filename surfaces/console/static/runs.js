// Runs: a live list over SSE (GET /v1/events), filtered by state and lane.
import { stream, tool } from "./api.js";
import { age, h } from "./dom.js";

const STATES = ["", "queued", "routing", "planning", "running", "synthesizing", "done", "failed",
  "cancelled", "interrupted", "budget_exhausted"];

function summary(run) {
  const ended = ["done", "failed", "skipped", "cancelled"];
  return {
    id: run.id, state: run.state, lane: run.lane, client: run.client, request: run.request,
    lanes: [...new Set(run.tasks.map((t) => t.lane).filter(Boolean))],
    tasks_total: run.tasks.length, tasks_done: run.tasks.filter((t) => ended.includes(t.state)).length,
    created_at_us: run.created_at_us,
  };
}

export async function runsPage(main) {
  const runs = new Map();
  const state = h("select", { id: "filter-state" }, STATES.map((s) => h("option", { value: s }, s || "any state")));
  const lane = h("select", { id: "filter-lane" }, h("option", { value: "" }, "any lane"));
  const body = h("tbody");
  main.append(
    h("h1", {}, "Runs"),
    h("div", { class: "filters" }, state, lane),
    h("table", { id: "runs" },
      h("thead", {}, h("tr", {}, ["run", "state", "lane", "tasks", "age", "client", "request"].map((c) => h("th", {}, c)))),
      body),
  );
  let queued = false;
  const draw = () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => {
      queued = false;
      const rows = [...runs.values()]
        .filter((r) => (!state.value || r.state === state.value) && (!lane.value || (r.lanes?.length ? r.lanes.includes(lane.value) : r.lane === lane.value)))
        .sort((a, b) => b.created_at_us - a.created_at_us)
        .slice(0, 200)
        .map((r) => h("tr", { "data-run": r.id, class: `state-${r.state}` },
          h("td", {}, h("a", { href: `#/run/${encodeURIComponent(r.id)}` }, r.id)),
          h("td", { class: "state" }, r.state),
          h("td", { class: "lane" }, r.lanes?.length ? r.lanes.join(", ") : r.lane || ""),
          h("td", {}, `${r.tasks_done}/${r.tasks_total}`),
          h("td", {}, age(r.created_at_us)),
          h("td", {}, r.client || ""),
          h("td", { class: "request" }, r.request.slice(0, 120))));
      body.replaceChildren(...rows);
    });
  };
  const load = async () => {
    const list = await tool("runs_list", { limit: 100, ...(state.value ? { state: state.value } : {}) });
    for (const run of list.runs) runs.set(run.id, summary(run));
    draw();
  };
  state.addEventListener("change", load);
  lane.addEventListener("change", draw);
  tool("roster_get").then((r) => {
    for (const l of r.roster.lanes || []) lane.append(h("option", { value: l.name }, l.name));
  }).catch(() => {});
  let connected = 0;
  const source = stream("/v1/events", {
    // opened before the first load, so nothing falls between; a reconnect catches up
    ready: () => (connected++ ? load().catch(() => {}) : null),
    run: (run) => { runs.set(run.id, run); draw(); },
  });
  const ticker = setInterval(draw, 5000);
  await load();
  return () => { source.close(); clearInterval(ticker); };
}
