// The ledger: entries by run, kind and actor, with bodies and causal chains; verify status and
// the latest checkpoint; redaction (admin); and "verify in this browser" on any entry.
import { allows, recordSchema, tool } from "./api.js";
import { fail, h, json } from "./dom.js";
import { checkBody } from "./schema.js";
import { parseVkey, verifyEntry } from "./verify.js";

const PIN = "tally.pinned-vkey";

async function keyBox(vkey) {
  const pinned = localStorage.getItem(PIN);
  const box = h("div", { id: "key" });
  const show = async (label, text) => {
    try {
      const k = await parseVkey(text);
      return h("p", {}, `${label}: ${k.name} · key id ${k.id} · key hash ${k.fingerprint.slice(0, 32)}…`);
    } catch (err) {
      return h("p", { class: "bad" }, `${label}: ${err.message}`);
    }
  };
  if (pinned) {
    box.append(await show("pinned key", pinned));
    if (vkey && vkey !== pinned) box.append(h("p", { class: "bad" }, "the daemon now presents a different key than the one pinned"));
    box.append(h("button", { id: "unpin", onclick: () => { localStorage.removeItem(PIN); location.reload(); } }, "Forget pinned key"));
  } else if (vkey) {
    box.append(await show("the daemon's key (not pinned yet: compare with checkpoint.vkey in its state dir)", vkey),
      h("button", { id: "pin", onclick: () => { localStorage.setItem(PIN, vkey); location.reload(); } }, "Pin this key"));
  }
  return box;
}

async function verifyHere(seq, out) {
  out.replaceChildren(h("p", {}, "verifying…"));
  const vkey = localStorage.getItem(PIN);
  if (!vkey) {
    out.replaceChildren(h("p", { class: "bad", id: "verify-result" }, "fail: pin a key first (top of this page)"));
    return;
  }
  const cp = (await tool("ledger_checkpoint")).checkpoint;
  if (!cp) throw new Error("no signed checkpoint yet");
  if (seq >= cp.size) {
    out.replaceChildren(h("p", { class: "bad", id: "verify-result" }, `entry ${seq} is newer than the latest checkpoint (size ${cp.size}); try again after the next one`));
    return;
  }
  const entry = await tool("ledger_get", { seq, bodies: false, line: true });
  const proof = await tool("ledger_proof", { kind: "inclusion", seq, size: cp.size });
  const result = await verifyEntry({ seq, line: entry.line, proof, note: cp.note, vkey });
  out.replaceChildren(
    h("ol", { class: "steps" }, result.steps.map((s) => h("li", { class: s.ok ? "ok" : "bad" }, `${s.ok ? "✓" : "✗"} ${s.step}: ${s.detail}`))),
    h("p", { id: "verify-result", class: result.ok ? "ok" : "bad" }, result.ok ? "pass: this entry is in the signed tree" : "fail"));
}

// Whether the body fits its kind's published schema (shown beside the body).
async function bodyCheck(e) {
  if (!e.body || e.body_state !== "present") return null;  // no body to check (redacted, missing, tampered)
  const verdict = checkBody(await recordSchema(), e.kind, e.content);
  const mark = verdict.ok === null ? "·" : verdict.ok ? "✓" : "✗";
  const cls = verdict.ok === false ? "bad" : "ok";
  return h("p", { id: "body-schema", class: cls }, `${mark} body: ${verdict.detail}`);
}

async function detail(seq, pane) {
  const e = await tool("ledger_get", { seq });
  const chain = await tool("causal_chain", { seq });
  const result = h("div", { id: "verify-steps" });
  const note = h("div");
  const reason = h("input", { id: "redact-reason", placeholder: "reason (witnessed)" });
  const redact = async () => {
    note.replaceChildren();
    try {
      await tool("ledger_redact", { body_hash: e.body, reason: reason.value });
      note.append(h("p", { class: "ok" }, "redacted"));
    } catch (err) { fail(note, err); }
  };
  pane.replaceChildren(
    h("h2", {}, `Entry ${e.seq}: ${e.kind}`),
    h("button", { id: "verify-here", onclick: () => verifyHere(seq, result).catch((err) => fail(result, err)) }, "Verify in this browser"),
    result,
    json({ ...e, content: undefined }),
    h("h3", {}, e.redacted ? "Body (redacted)" : "Body"), await bodyCheck(e).catch(() => null), json(e.content),
    e.body && !e.redacted && (await allows("admin")) ? h("div", { class: "redact" }, reason, h("button", { id: "redact", onclick: redact }, "Redact body (admin)"), note) : null,
    h("h3", {}, "Causal chain"),
    h("ol", { id: "chain" }, chain.entries.map((c) => h("li", {}, h("a", { href: `#/ledger/${c.seq}` }, `${c.seq} ${c.kind}`), ` by ${c.actor}`))));
}

const PAGE = 100;

// The newest `n` entries matching `filters` with seq < `before`, newest first. The ledger is
// read forwards only, so look back over a window that grows 4x until it holds `n` matches or
// reaches seq 0 (as `tally ledger show --tail` does).
async function newest(filters, before, n) {
  for (let width = n; ; width *= 4) {
    const start = Math.max(0, before - width);
    const found = [];
    for (let from = start; from < before;) {
      const page = await tool("ledger_entries", { ...filters, start: from, limit: 1000 });
      const inside = page.entries.filter((e) => e.seq < before);
      found.push(...inside);
      if (page.entries.length < 1000 || inside.length < page.entries.length) break;
      from = page.entries.at(-1).seq + 1;
    }
    if (found.length >= n || start === 0) return found.slice(-n).reverse();
  }
}

export async function ledgerPage(main, a, b) {
  const [verify, cp] = await Promise.all([tool("ledger_verify"), tool("ledger_checkpoint")]);
  const run = h("input", { id: "filter-run", placeholder: "run", value: a === "run" ? b : "" });
  const kind = h("input", { id: "filter-kind", placeholder: "kind (e.g. model.call)" });
  const actor = h("input", { id: "filter-actor", placeholder: "actor / client" });
  const list = h("tbody");
  const pane = h("div", { id: "entry" });
  // Newest first, a page at a time: `pages` holds the `before` cursor of each page shown so far.
  let pages = [];
  let oldest = 0;
  const newer = h("button", { id: "newer" }, "← newer");
  const older = h("button", { id: "older" }, "older →");
  const where = h("span", { id: "page-where" });
  const load = async () => {
    if (!pages.length) pages = [(await tool("health")).ledger_size];
    const filters = {};
    if (run.value) filters.run = run.value;
    if (kind.value) filters.kind = kind.value;
    if (actor.value) filters.actor = actor.value;
    const found = await newest(filters, pages.at(-1), PAGE);
    oldest = found.length ? found.at(-1).seq : 0;
    newer.disabled = pages.length < 2;
    older.disabled = found.length < PAGE || oldest === 0;
    where.textContent = found.length ? ` page ${pages.length}: seq ${found[0].seq} to ${oldest} ` : " no entries ";
    list.replaceChildren(...found.map((e) => h("tr", { "data-seq": e.seq },
      h("td", {}, h("a", { href: `#/ledger/${e.seq}` }, e.seq)), h("td", {}, new Date(e.ts / 1000).toLocaleString()),
      h("td", {}, e.kind), h("td", {}, e.actor), h("td", {}, e.run || ""), h("td", {}, e.parent ?? ""))));
  };
  const again = () => load().catch((err) => fail(pane, err));
  newer.addEventListener("click", () => { pages.pop(); again(); });
  older.addEventListener("click", () => { pages.push(oldest); again(); });
  for (const input of [run, kind, actor]) input.addEventListener("change", () => { pages = []; again(); });
  const checkpoint = cp.checkpoint;
  main.append(h("h1", {}, "Ledger"),
    h("p", { id: "verify-status", class: verify.ok ? "ok" : "bad" },
      verify.ok ? `verified: ${verify.size} entries, root ${verify.root?.slice(0, 16)}…` : `verify failed at ${verify.first_bad_seq}: ${verify.reason}`),
    h("p", { id: "checkpoint" }, checkpoint ? `latest checkpoint: size ${checkpoint.size}, root ${checkpoint.root.slice(0, 16)}…, ${new Date(checkpoint.time_us / 1000).toISOString()}` : "no checkpoint yet"),
    await keyBox(cp.vkey),
    h("div", { class: "filters" }, run, kind, actor),
    h("div", { class: "paging" }, newer, where, older),
    h("div", { class: "split" },
      h("table", { id: "entries" }, h("thead", {}, h("tr", {}, ["seq", "time", "kind", "actor", "run", "parent"].map((c) => h("th", {}, c)))), list),
      pane));
  await load();
  if (a && /^[0-9]+$/.test(a)) await detail(Number(a), pane);
}
