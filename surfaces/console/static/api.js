// Everything the console reads goes through the tool registry (POST /v1/tools/{name}) and the
// SSE streams: it shows nothing the API does not.
export class ToolError extends Error {
  constructor(status, error) {
    super(`${error.code}: ${error.message}`);
    this.status = status;
    this.code = error.code;
  }
}

export async function tool(name, args = {}) {
  const resp = await fetch(`/v1/tools/${name}`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(args),
    credentials: "same-origin",
  });
  const body = await resp.json();
  if (!resp.ok) throw new ToolError(resp.status, body.error || { code: "http", message: "" });
  return body;
}

// All of a run's entries (with bodies), page by page, after seq `after`.
export async function runEntries(run, after = -1) {
  const out = [];
  let start = after + 1;
  for (;;) {
    const page = await tool("ledger_entries", { run, start, limit: 1000, bodies: true });
    out.push(...page.entries);
    if (page.entries.length < 1000) return out;
    start = page.entries[page.entries.length - 1].seq + 1;
  }
}

export function stream(url, handlers) {
  const source = new EventSource(url);
  for (const [kind, fn] of Object.entries(handlers)) {
    source.addEventListener(kind, (ev) => fn(ev.data ? JSON.parse(ev.data) : null, ev));
  }
  return source;
}
