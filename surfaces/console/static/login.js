// The login page: POSTs the one-time code from this URL's fragment (never sent in a request
// line, so never in a log) and keeps the session secret the daemon answers in this origin's
// storage; every API call sends it in a header (see api.js). A GET changes nothing.
import { SESSION_KEY } from "./api.js";

const status = document.getElementById("login-status");
const params = new URLSearchParams(location.hash.replace(/^#/, "") || location.search);
const code = params.get("code");
history.replaceState(null, "", location.pathname); // the code leaves the address bar and history

async function login() {
  if (!code) throw new Error("this URL has no login code: run `tally console` again");
  const resp = await fetch("/console/login", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ code }),
    credentials: "omit",
    cache: "no-store",
  });
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new Error(body.error?.message || `login refused (${resp.status})`);
  localStorage.setItem(SESSION_KEY, body.session);
  location.replace("/");
}

login().catch((err) => {
  status.className = "error";
  status.textContent = String(err.message || err);
});
