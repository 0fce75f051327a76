// Everything the console reads goes through the tool registry (POST /v1/tools/{name}) and the
// SSE streams: it shows nothing the API does not. Every request carries the session secret in
// a header (no cookie: another local port would receive a cookie, and could set one).
export const SESSION_KEY = "tally.session";
const HEADER = "X-Tally-Session";
const SCOPES = ["read", "submit", "command", "admin"];

export class ToolError extends Error {
  constructor(status, error) {
    super(`${error.code}: ${error.message}`);
    this.status = status;
    this.code = error.code;
  }
}

function headers(extra = {}) {
  const secret = localStorage.getItem(SESSION_KEY);
  return secret ? { ...extra, [HEADER]: secret } : extra;
}

// The session is gone (expired, revoked, a daemon restart): say how to get a new one, once.
function signedOut() {
  localStorage.removeItem(SESSION_KEY);
  const main = document.getElementById("main");
  if (!main || document.getElementById("signed-out")) return;
  main.replaceChildren();
  const p = document.createElement("p");
  p.id = "signed-out";
  p.className = "error";
  p.textContent = "Not signed in (or the session ended): run `tally console` and open the URL it prints.";
  main.append(p);
}

async function request(method, url, body) {
  const resp = await fetch(url, {
    method,
    headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
    body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "omit",
  });
  const answer = await resp.json().catch(() => ({ error: { code: "http", message: resp.statusText } }));
  if (resp.status === 401) signedOut();
  if (!resp.ok) throw new ToolError(resp.status, answer.error || { code: "http", message: "" });
  return answer;
}

export function tool(name, args = {}) {
  return request("POST", `/v1/tools/${name}`, args);
}

let vocabulary = null;
// The record's published vocabulary (every kind's JSON Schema), asked once per page load.
export function recordSchema() {
  vocabulary ||= request("GET", "/v1/record/schema");
  return vocabulary;
}

let who = null;
// Who this session is ({client, scope, expires_in_s}), asked once per page load.
export function session() {
  who ||= localStorage.getItem(SESSION_KEY)
    ? request("GET", "/v1/console/session")
    : Promise.reject(new ToolError(401, { code: "unauthorized", message: "not signed in" }));
  return who;
}

// Whether the session's scope covers `needed` (read < submit < command < admin).
export async function allows(needed) {
  try {
    return SCOPES.indexOf((await session()).scope) >= SCOPES.indexOf(needed);
  } catch {
    return false;
  }
}

export async function logout() {
  try {
    await request("POST", "/console/logout", {});
  } finally {
    localStorage.removeItem(SESSION_KEY);
    signedOut();
  }
}

export { signedOut };

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

// An SSE stream read with fetch (EventSource cannot send the session header), with what the
// pages use of EventSource: named events to `handlers` and addEventListener, `onmessage`,
// close(), and reconnection after `retry` ms with Last-Event-ID. A 401/403 ends it.
export function stream(url, handlers) {
  const target = new EventTarget();
  const control = new AbortController();
  const source = {
    onmessage: null,
    addEventListener: (kind, fn) => target.addEventListener(kind, fn),
    close: () => control.abort(),
  };
  for (const [kind, fn] of Object.entries(handlers)) {
    target.addEventListener(kind, (ev) => fn(ev.data ? JSON.parse(ev.data) : null, ev));
  }
  let last = null;
  let retry = 1000;
  const dispatch = (kind, data, id) => {
    const ev = new MessageEvent(kind, { data, lastEventId: id ?? last ?? "" });
    if (kind === "message" && source.onmessage) source.onmessage(ev);
    target.dispatchEvent(ev);
  };
  const read = async () => {
    const extra = last !== null ? { "Last-Event-ID": last } : {};
    const resp = await fetch(url, { headers: headers(extra), credentials: "omit", cache: "no-store", signal: control.signal });
    if (resp.status === 401 || resp.status === 403) {
      if (resp.status === 401) signedOut();
      return false;
    }
    if (!resp.ok || !resp.body) return true;
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let kind = "";
    let data = [];
    let id = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return true;
      buffer += value;
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {
          if (id !== null) last = id;
          if (data.length) dispatch(kind || "message", data.join("\n"), id);
          kind = "";
          data = [];
          id = null;
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") kind = value;
        else if (field === "data") data.push(value);
        else if (field === "id") id = value;
        else if (field === "retry" && /^[0-9]+$/.test(value)) retry = Number(value);
      }
    }
  };
  (async () => {
    while (!control.signal.aborted) {
      let again = true;
      try {
        again = await read();
      } catch {
        again = !control.signal.aborted;
      }
      if (!again || control.signal.aborted) return;
      await new Promise((resolve) => setTimeout(resolve, retry));
    }
  })();
  return source;
}
