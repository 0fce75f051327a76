// A run: the DAG with live states, a timeline, each task's attempts and output (with its
// checks and the files it changed), the workspace patch, the answer, cancel and resume. Live
// over the run's SSE stream; the rest through the tool registry.
import { allows, runEntries, stream, tool } from "./api.js";
import { fail, h, json } from "./dom.js";
import { dag } from "./graph.js";

const STOPS = { "run.interrupted": "interrupted", failed: "failed", cancelled: "cancelled", budget_exhausted: "budget exhausted" };

// Per task, its attempts as the record tells them. An attempt still open when the run stopped
// (the daemon stopped: interrupted; or the run failed, was cancelled or ran out of budget) is
// cut there: `cut` says why, and its time ends at that entry, not at the run's last one.
export function attempts(entries) {
  const tasks = new Map();
  const byCall = new Map();
  let current = null;
  const task = (id) => {
    if (!tasks.has(id)) tasks.set(id, []);
    return tasks.get(id);
  };
  for (const e of entries) {
    const b = e.content || {};
    if (e.kind === "task.start") {
      current = { attempt: b.attempt, tier: b.tier, executor: b.executor, start: e.ts, calls: [], seq: e.seq };
      task(b.task).push(current);
    } else if (e.kind === "model.call" && b.task) {
      const att = task(b.task).at(-1);
      const call = { member: b.member, instance: b.instance, slot: b.slot, at: e.ts, seq: e.seq };
      if (att) att.calls.push(call);
      byCall.set(e.seq, call);
    } else if (e.kind === "model.reply") {
      const call = byCall.get(e.parent);
      if (call) {
        call.done = e.ts;
        call.usage = b.usage;
        call.timings = b.timings;
        call.error = b.error;
      }
    } else if (e.kind === "agent.step") {
      // One step of an agent task's tool loop; every text in it was written by a model.
      const att = task(b.task).at(-1);
      if (!att) continue;
      const t = b.timings || {};
      (att.steps ||= []).push({
        step: b.step, tool: b.tool, args: b.arguments || {}, outcome: b.outcome, parse: b.parse,
        observation: b.observation, reply: b.reply, tokens: b.tokens || {}, member: b.member, slot: b.slot,
        at: e.ts - (t.step_us || 0), done: e.ts, modelUs: t.model_us || 0, toolUs: t.tool_us || 0, seq: e.seq,
      });
    } else if (["task.result", "task.verdict", "task.escalate", "command.run", "task.diff", "check.run"].includes(e.kind)) {
      const att = task(b.task).at(-1);
      if (!att) continue;
      if (e.kind === "task.result") Object.assign(att, { end: e.ts, output: b.output, error: b.error, ok: b.ok });
      if (e.kind === "task.verdict") att.verdict = { ok: b.ok, failures: b.failures, judge: b.judge, next: b.next };
      if (e.kind === "task.escalate") att.escalate = { from: b.from_tier, to: b.to_tier, reason: b.reason };
      if (e.kind === "command.run") att.command = { exit: b.exit_code, ms: b.duration_ms };
      if (e.kind === "task.diff") att.diff = { files: b.files || [], error: b.error };
      if (e.kind === "check.run") (att.checks ||= []).push({ argv: b.argv, exit: b.exit_code, timedOut: b.timed_out, tail: [b.stdout_tail, b.stderr_tail].filter(Boolean).join("\n") });
    } else if (e.kind === "run.interrupted" || (e.kind === "run.state" && STOPS[b.state])) {
      const why = STOPS[e.kind] || STOPS[b.state];
      for (const list of tasks.values()) {
        const att = list.at(-1);
        if (att && att.end === undefined) Object.assign(att, { end: e.ts, cut: why });
      }
    }
  }
  return tasks;
}

// A time axis under the timeline: round steps (1, 2 or 5 × 10^k ms), about six of them.
function axis(t0, t1) {
  const ms = (t1 - t0) / 1000;
  const raw = ms / 6;
  const base = 10 ** Math.floor(Math.log10(Math.max(raw, 1)));
  const step = [1, 2, 5, 10].map((m) => m * base).find((s) => s >= raw) || base * 10;
  const label = (v) => (step >= 1000 ? `${(v / 1000).toFixed(step % 1000 ? 1 : 0)} s` : `${v.toFixed(0)} ms`);
  const ticks = [];
  for (let v = 0; v <= ms + 1e-9; v += step) {
    const tick = h("span", { class: "tick" }, label(v));
    tick.style.left = `${((v / Math.max(ms, 1e-9)) * 100).toFixed(2)}%`;
    ticks.push(tick);
  }
  return h("div", { class: "tl-row tl-axis" }, h("span", { class: "tl-label" }, "time"), h("span", { class: "tl-track axis" }, ticks));
}

function timeline(entries, tasks) {
  if (!entries.length) return h("p", {}, "no entries yet");
  const t0 = entries[0].ts;
  const t1 = Math.max(entries.at(-1).ts, t0 + 1);
  const pct = (t) => `${(((t - t0) / (t1 - t0)) * 100).toFixed(2)}%`;
  const rows = [];
  let peak = 0;
  const spans = [];
  for (const [id, list] of tasks) {
    const bars = [];
    for (const a of list) {
      const end = a.end || entries.at(-1).ts;
      spans.push([a.start, end]);
      const first = a.calls[0] || a.steps?.[0]; // an agent's first step is its first model call
      // Until its first model call a chat attempt waits for a slot; a command runs at once.
      const queued = first ? first.at : a.executor === "command" ? a.start : end;
      const wait = h("span", { class: "bar wait", title: `queue wait ${((queued - a.start) / 1000).toFixed(0)} ms` });
      wait.style.left = pct(a.start);
      wait.style.width = pct(t0 + queued - a.start);
      const model = h("span", { class: `bar model${a.cut ? " cut" : ""}`, title: `attempt ${a.attempt}${a.cut ? ` (${a.cut})` : ""}: ${((end - queued) / 1000).toFixed(0)} ms` });
      model.style.left = pct(queued);
      model.style.width = pct(t0 + Math.max(end - queued, 0));
      bars.push(wait, model);
      for (const st of a.steps || []) { // an agent's steps: one tick each, its tool in the title
        const tick = h("span", { class: `bar step step-${st.outcome}`, title: `step ${st.step}: ${st.tool || "(no call)"} → ${st.outcome}` });
        tick.style.left = pct(st.at);
        tick.style.width = pct(t0 + Math.max(st.done - st.at, 0));
        bars.push(tick);
      }
    }
    rows.push(h("div", { class: "tl-row", "data-task": id }, h("span", { class: "tl-label" }, id), h("span", { class: "tl-track" }, bars)));
  }
  rows.push(axis(t0, t1));
  for (const [s] of spans) peak = Math.max(peak, spans.filter(([a, b]) => a <= s && s < b).length);
  return h("div", { id: "timeline" },
    h("p", {}, `makespan ${((t1 - t0) / 1000).toFixed(0)} ms · peak parallelism ${peak} · grey = queue wait, blue = model/executor, hatched = cut off`),
    rows);
}

const CUT = 4000;
const cut = (text, n = CUT) => { const s = String(text ?? ""); return s.length > n ? `${s.slice(0, n - 1)}…` : s; };
const argsText = (args) => Object.entries(args).filter(([, v]) => v !== null && v !== undefined).map(([k, v]) => `${k}=${cut(typeof v === "string" ? v : JSON.stringify(v), 80)}`).join(", ");

// An agent attempt's steps as a timeline: time since the attempt began, the tool and its
// arguments, the outcome, tokens (cached of prompt) and time; the observation and the model's
// reply open below. Every text goes in as text (dom.h): the model's output is hostile.
function stepsView(a) {
  if (!a.steps?.length) return null;
  return h("ol", { class: "steps" }, a.steps.map((st) => h("li", { class: `step step-${st.outcome}`, "data-step": st.step },
    h("details", {},
      h("summary", {}, `+${((st.at - a.start) / 1e6).toFixed(1)} s · step ${st.step} · `,
        h("code", {}, `${st.tool || "(no call)"}(${cut(argsText(st.args), 200)})`),
        ` → ${st.outcome} · ${st.tokens.prompt ?? "?"}+${st.tokens.completion ?? "?"} tokens (${st.tokens.cached ?? 0} cached) · model ${(st.modelUs / 1000).toFixed(0)} ms, tool ${(st.toolUs / 1000).toFixed(0)} ms · seq ${st.seq}`),
      h("pre", { class: "observation" }, cut(st.observation)),
      st.parse !== "native" ? h("pre", { class: "reply" }, cut(st.reply)) : null))));
}

function attemptView(a, streaming) {
  const calls = a.calls.map((c) => {
    const u = c.usage || {};
    const ms = c.done ? ((c.done - c.at) / 1000).toFixed(0) : "…";
    return h("li", {}, `${c.member} #${c.instance} slot ${c.slot} · ${u.prompt_tokens ?? "?"}+${u.completion_tokens ?? "?"} tokens · ${ms} ms`, c.error ? ` · error: ${c.error}` : "");
  });
  const v = a.verdict;
  const open = a.output === undefined && !a.cut; // still running: its tokens stream in
  const summary = a.cut ? `output (${a.cut})` : open ? "output (streaming)" : "output";
  const shown = a.output ?? (streaming || (a.cut ? `(${a.cut} before it wrote anything)` : "(running)"));
  return h("div", { class: `attempt${a.cut ? " cut" : ""}`, "data-attempt": a.attempt },
    h("div", {}, `attempt ${a.attempt}${a.tier ? ` on ${a.tier}` : ""}`, a.command ? ` · exit ${a.command.exit} in ${a.command.ms} ms` : "",
      a.cut ? h("span", { class: "bad cut-note" }, ` · ${a.cut} after ${((a.end - a.start) / 1000).toFixed(0)} ms, at ${new Date(a.end / 1000).toLocaleTimeString()}`) : ""),
    h("ul", {}, calls),
    stepsView(a),
    v ? h("div", { class: v.ok ? "ok" : "bad" }, `verdict: ${v.ok ? "pass" : "fail"} → ${v.next}`, v.failures?.length ? ` (${v.failures.join("; ")})` : "", v.judge ? ` · judge: ${v.judge.reason || v.judge.ok}` : "") : null,
    a.escalate ? h("div", { class: "bad" }, `escalated ${a.escalate.from} → ${a.escalate.to}: ${a.escalate.reason}`) : null,
    a.diff ? h("div", {}, `changed: ${a.diff.files.join(", ") || "nothing"}`, a.diff.error ? ` · ${a.diff.error}` : "") : null,
    (a.checks || []).map((c) => h("details", { class: c.exit === 0 ? "ok check" : "bad check" },
      h("summary", {}, `check \`${c.argv.join(" ")}\` ${c.timedOut ? "timed out" : `exited ${c.exit}`}`),
      h("pre", {}, c.tail || "(no output)"))),
    a.error ? h("div", { class: "bad" }, `error: ${a.error}`) : null,
    h("details", { class: "output", open: open && streaming ? true : undefined },
      h("summary", {}, summary),
      h("pre", {}, shown)));
}

// A run's lanes as a person should read them: its tasks' lanes once it has a plan (a `--plan`
// run's routed lane is only where its request text would have gone).
export function lanesOf(run) {
  const lanes = [...new Set(run.tasks.map((t) => t.lane).filter(Boolean))];
  if (!lanes.length) return `lane ${run.lane || "?"}`;
  return lanes.length === 1 ? `lane ${lanes[0]}` : `lanes ${lanes.join(", ")}`;
}

const ENDED = ["done", "failed", "cancelled", "interrupted", "budget_exhausted"];

// The answer; or, for a run that stopped without one, why, and the work it did: its partial
// answer (the finished tasks' outputs, witnessed as such), else the answer's text as far as
// the synthesis wrote it, else each finished task's output.
function answerView(run, entries, streamed) {
  if (run.answer && (run.state === "done" || !ENDED.includes(run.state))) return [h("pre", { id: "answer-text" }, run.answer)];
  if (!ENDED.includes(run.state)) return [h("p", {}, "no answer yet")];
  const said = h("p", { id: "answer-missing", class: "bad" }, `no answer: the run ${run.state.replace("_", " ")}${run.error ? `: ${run.error}` : ""}`);
  if (run.answer) return [said, h("p", {}, "partial work: what the finished tasks did"), h("pre", { id: "answer-partial" }, run.answer)];
  const synthesis = new Set(entries.filter((e) => e.kind === "model.call" && e.content?.purpose === "synthesize").map((e) => e.seq));
  const written = entries.filter((e) => e.kind === "model.reply" && synthesis.has(e.parent) && e.content?.text).map((e) => e.content.text).at(-1) || streamed;
  if (written) return [said, h("p", {}, "the answer as far as it was written:"), h("pre", { id: "answer-partial" }, written)];
  const done = run.tasks.filter((t) => t.state === "done" && t.result);
  if (!done.length) return [said];
  return [said, h("p", {}, "partial work: the tasks that finished"),
    h("div", { id: "answer-partial" }, done.map((t) => h("div", {}, h("h3", {}, `${t.id} · ${t.lane}`), h("pre", {}, t.result))))];
}

const FINAL = ["done", "failed", "cancelled", "budget_exhausted"];
const RESUMABLE = ["interrupted"];

export async function runPage(main, id) {
  const canAct = await allows("submit"); // run_cancel and run_resume need scope submit
  let entries = [];
  let run = null;
  const streaming = new Map(); // task id -> the tokens streamed so far by its running attempt
  const head = h("div", { id: "run-head" });
  const graph = h("div", { id: "graph" });
  const time = h("div");
  const taskList = h("div", { id: "tasks" });
  const live = h("pre", { id: "live" });
  const answer = h("div", { id: "answer" });
  const note = h("div");
  const patchHead = h("h2", { hidden: true }, "Patch");
  const patch = h("div", { id: "patch" });
  let patchSeq = null;
  main.append(h("h1", {}, "Run ", h("code", {}, id)), head, note,
    h("h2", {}, "Tasks"), graph, h("h2", {}, "Timeline"), time, h("h2", {}, "Attempts"), taskList,
    patchHead, patch, h("h2", {}, "Answer"), live, answer);
  // The workspace patch as a diff, one line each, added and removed lines marked (text nodes).
  const showPatch = async () => {
    if (!run.workspace) return;
    patchHead.hidden = false;
    if (run.patch_seq == null) {
      patch.replaceChildren(h("p", {}, `works on a copy of ${run.workspace}; no patch yet`));
      return;
    }
    if (patchSeq === run.patch_seq) return;
    patchSeq = run.patch_seq;
    const got = await tool("run_patch", { run_id: id });
    const lines = (got.patch || "").split("\n").map((line) => h("span", {
      class: line.startsWith("+") && !line.startsWith("+++") ? "diff-add" : line.startsWith("-") && !line.startsWith("---") ? "diff-del" : line.startsWith("@@") ? "diff-hunk" : "",
    }, line + "\n"));
    patch.replaceChildren(
      h("p", {}, got.error ? `no patch: ${got.error}` : `${got.files.length} file(s) changed in a copy of ${got.workspace}: `,
        h("code", {}, `tally apply ${id}`), " applies it"),
      h("pre", { id: "patch-text" }, got.patch ? lines : "(no change)"));
  };
  const act = (name) => async () => {
    note.replaceChildren();
    try { await tool(name, { run_id: id }); await refresh(); } catch (err) { fail(note, err); }
  };
  const draw = () => {
    const per = attempts(entries);
    head.replaceChildren(
      h("p", {}, h("span", { id: "run-state", class: `state-${run.state}` }, run.state), ` · ${lanesOf(run)} · client ${run.client || "?"} · ${run.spent.model_calls} calls · ${run.spent.tokens} tokens · ${run.spent.wall_ms} ms`),
      h("p", { class: "request" }, run.request),
      // only what this session may do to this run: a finished run has nothing to cancel
      ...(canAct && !FINAL.includes(run.state) ? [h("button", { id: "cancel", onclick: act("run_cancel") }, "Cancel"), " "] : []),
      ...(canAct && RESUMABLE.includes(run.state) ? [h("button", { id: "resume", onclick: act("run_resume") }, "Resume"), " "] : []),
      h("a", { href: `#/ledger/run/${encodeURIComponent(id)}` }, "entries in the ledger"));
    graph.replaceChildren(dag(run.tasks));
    time.replaceChildren(timeline(entries, per));
    taskList.replaceChildren(...run.tasks.map((t) => h("section", { class: "task", "data-task": t.id },
      h("h3", {}, `${t.id} · ${t.lane} · ${t.state}`),
      (per.get(t.id) || []).map((a, i, all) => attemptView(a, i === all.length - 1 ? streaming.get(t.id) : undefined)))));
    answer.replaceChildren(...answerView(run, entries, live.textContent));
    live.hidden = Boolean(run.answer) || !live.textContent; // the streamed answer, until it is witnessed
  };
  const refresh = async () => {
    run = await tool("run_get", { run_id: id });
    entries = entries.concat(await runEntries(id, entries.length ? entries.at(-1).seq : run.request_seq - 1));
    draw();
    await showPatch();
  };
  let timer = null;
  const soon = (ev) => {
    if (ev && ev.type === "task.start") streaming.delete(JSON.parse(ev.data).task);
    timer ||= setTimeout(() => { timer = null; refresh().catch((e) => fail(note, e)); }, 250); };
  await refresh();
  const source = stream(`/v1/runs/${encodeURIComponent(id)}/events?after=${entries.length ? entries.at(-1).seq : ""}`, {
    delta: (d) => {
      if (!d.task) {
        live.textContent += d.text;
        live.hidden = false;
        return;
      }
      streaming.set(d.task, (streaming.get(d.task) || "") + d.text);
      const pre = taskList.querySelector(`section[data-task="${CSS.escape(d.task)}"] .attempt:last-child details.output pre`);
      if (pre && pre.parentElement.firstChild.textContent === "output (streaming)") pre.textContent = streaming.get(d.task);
    },
    end: () => { source.close(); soon(); },
  });
  source.onmessage = soon;
  for (const kind of ["task.start", "task.result", "task.verdict", "task.escalate", "task.skip", "model.call", "model.reply", "run.plan", "run.route", "run.answer", "run.state", "run.cancel", "run.resume", "run.interrupted", "task.diff", "check.run", "run.patch", "agent.step"]) {
    source.addEventListener(kind, soon);
  }
  return () => { source.close(); clearTimeout(timer); };
}

export { json };
