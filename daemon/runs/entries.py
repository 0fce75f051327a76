"""Every ledger entry kind the runs engine writes, and the shape of its body — in one place.

All bodies hold only JSON null/bool/str/int/list/dict (no floats): confidences and scores are
parts per million (`*_ppm`), durations integer milliseconds (`*_ms`) or microseconds (`*_us`).
Values passed through as given (a plan's `timeout_s`, a request's sampling parameters) go
through `safe`: each float becomes {"__float__": "<repr>"}, which `unsafe` reverses.
Every entry carries `run` = the run id. `parent` (in brackets) makes the causal chain, so
`causal_chain(answer)` reads request → route → plan → task.start → model.call → model.reply
→ task.result → task.verdict → [synthesis call → reply] → run.answer.

Actor is "engine" for everything here; the daemon writes `slot.*` entries with actor "pool"
(body = SlotEvent fields) and the reconcile entries (`run.interrupted`) with actor "daemon".
"""

from __future__ import annotations

from typing import Final

# Their home is the ledger's canonical JSON; named here for the engine's steps.
from daemon.ledger.canonical import safe as safe
from daemon.ledger.canonical import unsafe as unsafe

ACTOR: Final = "engine"

REQUEST: Final = "run.request"
"""[none] {request: str, lane: str|null, plan: Plan|null (`safe`), budget: {model_calls, tokens,
wall_ms} (ints or null), max_parallel: int|null, barrier: bool, idempotency_key: str|null}
and, only when set: tier: str (the client's choice of the tier its tasks start on), member: str
(the member every task call goes to), retry_of: {run: str (a failed or cancelled run), state,
reuse: [task id] (its done tasks, taken as done: see task.reuse)}"""

ROUTE: Final = "run.route"
"""[run.request] {lane: str|null, confidence_ppm: int, escalate: bool, source: "router"|"client",
scores: [[lane, score_ppm], ...] (top 8), matched: {lane: [words]}}  (source "client": the
client named the lane; confidence 1 000 000, and since issue 31 the router's scores and matched
words with its own choice beside it: router: {lane: str|null, source: "router"|"scores"|
"general"|"classifier", classifier: str|null, candidates: [lane]}; before it, scores [] and
matched {} and no `router`)"""

CLASSIFY: Final = "run.classify"
"""[classifier model.reply or run.route] {lane: str, candidates: [lane], source: "model"|
"fallback"|"scores"|"general", error: str|null}  "model": the `[policy] classifier` chose among
the candidates (the best-scoring few, plus `general`); "fallback": it failed and the best score
stands; "scores": no classifier is configured, the best-scoring lane; "general": no lane's
words matched, the `general` lane — neither of the last two calls a model."""

PLAN: Final = "run.plan"
"""[run.route | run.classify | the coordinator's last model.reply] {source: "client"|"coordinator"|
"single"|"fallback", plan: Plan (`safe`), waves: [[task id]], critical_path: int,
error: str|null (why the coordinator's plan was not used, with source "fallback")}"""

GUARD: Final = "output.guard"
"""[model.reply] one structured-output attempt: {purpose: "classify"|"plan"|"judge", attempt: int,
outcome: "parsed"|"rescued_fenced"|"rescued_object"|"invalid", error: str|null}"""

TASK_START: Final = "task.start"
"""[run.plan, the last need's task.verdict, or task.escalate] {task, lane, executor, tier: str|null,
attempt: int (1-based), needs: [task id], feedback: [str] (what failed in the previous attempt)}"""

MODEL_CALL: Final = "model.call"
"""[task.start | run.route | run.plan's parent | last verdict] {purpose: "task"|"classify"|"plan"|
"judge"|"synthesize", task: str|null, target: tier or member, member, instance: int, slot: int,
request}  `request` is the request body sent to `/v1/chat/completions`, through `safe`, witnessed
before it goes out: {model, messages, max_tokens, cache_prompt: true, stream: bool, id_slot,
the member's sampling parameters that are set (temperature, top_p, top_k, min_p, repeat_penalty,
seed), response_format (when constrained), stream_options (when streamed)}. A server tally
spawns is always streamed (a closed stream is how a cancel stops it)."""

MODEL_REPLY: Final = "model.reply"
"""[model.call] {text, finish_reason: str|null, usage: {prompt_tokens, completion_tokens,
cached_tokens} (ints or null = not reported), timings: {name: int} (llama.cpp's, `*_ms` as
`*_us`: prompt_n, prompt_us, predicted_n, predicted_us, cache_n), member, instance, slot,
sent: null|{...}, error: str|null}  (an error reply has text "" and the error, no `sent`; its
tokens count as 0). `sent` is null when the pool sent exactly model.call's `request` (or did not
say what it sent); otherwise it is the body the pool did send, minus messages (`safe`) — e.g. an
external server without slots gets no id_slot. When the member is another tally daemon's
gateway (`tally = true` in the roster), `remote` = {member, seq: its gateway.reply entry,
checkpoint: its latest signed checkpoint size then}: `ledger_verify_remote` proves it there."""

COMMAND_RUN: Final = "command.run"
"""[task.start] {task, argv: [str], exit_code: int|null, timed_out: bool, stdout: str, stderr: str,
truncated: bool, duration_ms: int}"""

MODEL_RETRY: Final = "model.retry"
"""[the lost call's model.reply, or the call's parent when no lease was had] {purpose, task:
str|null, target, member: str|null (where it was lost; null: no member could serve), error: str,
lost: int (1-based: how many tries of this call were lost so far), retries: int (the bound),
wait_ms: int}  A call lost to its server (died, hung, dropped mid-stream, no member up) is
sent again through a new lease of the same target after `wait_ms`: a new model.call (parent:
this entry). It is not a failed attempt of the task. (A server that answers an error status
did answer: that is a failed attempt, as before.)"""

TASK_REUSE: Final = "task.reuse"
"""[run.plan] {task, from_run: str, from_seq: int|null (the original's done verdict), output: str}
— a retried run (`run.request` with `retry_of`) takes a task the original run had done as
done, with its output, and does not run it again."""

TASK_RESULT: Final = "task.result"
"""[model.reply | command.run | task.start] {task, attempt, ok: bool (the executor finished),
output: str (bounded), exit_code: int|null, error: str|null}"""

TASK_VERDICT: Final = "task.verdict"
"""[task.result | the attempt's last task.diff or check.run] {task, attempt, ok: bool,
failures: [str], judge: {ok, reason}|null, next: "done"|"retry"|"escalate"|"failed"}  "retry":
the same rung again with the failures as feedback (`[policy] attempts_per_rung`)."""

TASK_ESCALATE: Final = "task.escalate"
"""[task.verdict] {task, from_tier: str|null, to_tier: str, reason: str, failures: [str]}"""

TASK_SKIP: Final = "task.skip"
"""[run.plan] {task, reason} — a dependency failed (policy on_task_failure = "continue")."""

BUDGET: Final = "run.budget"
"""[run.request] {limit: "model_calls"|"tokens"|"wall", budget: {...}, spent: {model_calls,
tokens, wall_ms}}  — followed by run.state budget_exhausted. `wall_ms` is the time the run was
driven across resumes (see run.interrupted / run.resume)."""

CANCEL: Final = "run.cancel"
"""[run.request] {reason: str}"""

ANSWER: Final = "run.answer"
"""[synthesis model.reply | the single task's task.verdict | the last entry] {answer: str,
source: "single"|"synthesis"|"results"|"partial", looped: bool (with "synthesis": the summary
was cut where it began to repeat itself), error: str (only with source "results": why synthesis
failed)}. With several tasks the answer is the synthesis's short summary, then each done
task's result verbatim under a `## <task id> (<lane>)` heading, so a poor summary never hides
the work; "results" is the same without a summary. "partial" (parent: the last verdict): a
task failed and the run fails, but its done tasks' results are its answer still, with `error`
saying what failed; the run.state failed follows."""

INTENT: Final = "run.intent"
"""[run.answer] {coverage_ppm: int, keys: [str], missing: [str]}  (witnessed; never blocks)"""

STATE: Final = "run.state"
"""[run.answer | run.budget | run.cancel (a queued run) | run.request] {state: "done"|"failed"|
"cancelled"|"budget_exhausted", error: str|null}"""

INTERRUPTED: Final = "run.interrupted"
"""[run.request] {reason: str, previous: state, spent_wall_ms: int}  — written by the daemon on
start (reconcile) or on a stop that could not drain. `spent_wall_ms` is the wall time the run
was driven, all attempts together: on a stop, up to now; on reconcile after a crash, up to the
run's last witnessed entry (the time the daemon was down is not the run's). Older entries
without it: the reducer's own count (to the last entry) stands."""

RESUME: Final = "run.resume"
"""[run.answer | run.request] {reused: [task id], redo: [task id], stage: "route"|"dispatch",
spent: {model_calls, tokens, wall_ms}}  — `stage` "route": the run stopped before its plan was
witnessed, so it is routed (and planned) again, witnessed as a new run.route; "dispatch": the
plan stands and only the tasks in `redo` run. The budget carries over whole: calls, tokens and
wall time already spent (`spent`) count against it, the wall clock from `spent.wall_ms`."""

AGENT_STEP: Final = "agent.step"
"""[the task's previous agent.step, or task.start] one step of an `agent` task's tool loop:
{task, step: int (1-based), mode: "native"|"json", tool: str|null, arguments: {...},
parse: "native"|"parsed"|"fenced"|"object"|"repaired"|"malformed", outcome: "ok"|"error"|
"malformed"|"finish_refused"|"finished"|"stuck", reply: str, observation: str,
observation_sha256, tokens: {prompt, completion, cached}, timings: {model_us, tool_us, step_us,
server: {name: int}}, member, instance: int, slot: int, compacted: int}
(`daemon.runs.agent.record`). A step's model call is witnessed by its agent.step alone (no
model.call / model.reply) and counts as one model call with its tokens."""

KINDS: Final = (
    REQUEST,
    ROUTE,
    CLASSIFY,
    PLAN,
    GUARD,
    TASK_START,
    MODEL_CALL,
    MODEL_REPLY,
    MODEL_RETRY,
    COMMAND_RUN,
    TASK_RESULT,
    TASK_VERDICT,
    TASK_ESCALATE,
    TASK_SKIP,
    TASK_REUSE,
    BUDGET,
    CANCEL,
    ANSWER,
    INTENT,
    STATE,
    INTERRUPTED,
    RESUME,
    AGENT_STEP,
)
