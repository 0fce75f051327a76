// The pool: members, instances, slots busy/idle, queues per tier, recent slot.* events,
// tokens per second per member (from the record's summary).
import { tool } from "./api.js";
import { h } from "./dom.js";

export async function poolPage(main) {
  const [slots, summary, health] = await Promise.all([
    tool("slots_status"), tool("ledger_summary", { verify: false }), tool("health"),
  ]);
  const rate = (name) => {
    const m = summary.per_member[name];
    return m && m.ms ? (m.completion_tokens / (m.ms / 1000)).toFixed(1) : "";
  };
  main.append(h("h1", {}, "Pool"),
    h("table", { id: "members" },
      h("thead", {}, h("tr", {}, ["member", "healthy", "instances", "busy", "idle", "queue", "restarts", "tokens/s", "last error"].map((c) => h("th", {}, c)))),
      h("tbody", {}, slots.members.map((m) => h("tr", {},
        h("td", {}, m.name), h("td", {}, String(m.healthy)),
        h("td", {}, m.instances.map((i) => `#${i.index ?? ""} ${i.state}${i.port ? ` :${i.port}` : ""}`).join(", ")),
        h("td", {}, m.instances.reduce((n, i) => n + (i.slots_busy || 0), 0)),
        h("td", {}, m.instances.reduce((n, i) => n + (i.slots_idle || 0), 0)),
        h("td", {}, m.queue), h("td", {}, m.restarts), h("td", {}, rate(m.name)), h("td", {}, m.last_error || ""))))),
    h("h2", {}, "Tiers"),
    h("table", { id: "tiers" }, h("thead", {}, h("tr", {}, ["tier", "members", "queue", "failovers"].map((c) => h("th", {}, c)))),
      h("tbody", {}, (slots.tiers || []).map((t) => h("tr", {}, h("td", {}, t.name), h("td", {}, (t.members || []).join(", ")), h("td", {}, t.queue), h("td", {}, t.failovers))))),
  );
  const recent = await tool("ledger_entries", { actor: "pool", start: Math.max(0, health.ledger_size - 5000), limit: 1000 });
  main.append(h("h2", {}, "Recent slot events"),
    h("table", { id: "slot-events" }, h("tbody", {}, recent.entries.slice(-30).reverse().map((e) =>
      h("tr", {}, h("td", {}, h("a", { href: `#/ledger/${e.seq}` }, e.seq)), h("td", {}, e.kind), h("td", {}, new Date(e.ts / 1000).toISOString()))))));
}
