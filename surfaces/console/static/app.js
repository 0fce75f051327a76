// The console's router: #/runs, #/run/ID, #/compare/A/B, #/pool, #/ledger[/SEQ].
import { logout, session, signedOut, tool } from "./api.js";
import { h } from "./dom.js";
import { runsPage } from "./runs.js";
import { runPage } from "./run.js";
import { comparePage } from "./compare.js";
import { poolPage } from "./pool.js";
import { ledgerPage } from "./ledger.js";

let cleanup = () => {};
let shown = 0; // which route() call owns the page

// Each route renders into its own view. Two routes can overlap (the session resolving as a
// hashchange is queued, or quick clicks): the older one then fills a view no longer in the
// page, instead of appending a second copy of its page beside the newer one's.
async function route() {
  cleanup();
  cleanup = () => {};
  const mine = ++shown;
  const main = document.getElementById("main");
  const view = h("div", { class: "view" });
  main.replaceChildren(view);
  const [page, ...rest] = (location.hash.replace(/^#\/?/, "") || "runs").split("/").map(decodeURIComponent);
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("current", a.id === `nav-${page === "run" ? "runs" : page}`);
  }
  const pages = { runs: runsPage, run: runPage, compare: comparePage, pool: poolPage, ledger: ledgerPage };
  const render = pages[page] || runsPage;
  try {
    const done = (await render(view, ...rest)) || (() => {});
    if (mine === shown) cleanup = done;
    else done(); // a newer route owns the page: stop this one's streams now
  } catch (err) {
    view.append(h("p", { class: "error" }, String(err.message || err)));
  }
}

// No session in this origin's storage, or the daemon no longer knows it: say how to sign in.
session()
  .then((who) => {
    document.getElementById("signout").hidden = false;
    document.getElementById("signout").addEventListener("click", () => logout());
    window.addEventListener("hashchange", route);
    route();
    tool("health")
      .then((health) => {
        document.getElementById("who").textContent =
          `tally ${health.version} · ledger ${health.ledger_size} · ${who.client} (${who.scope})`;
      })
      .catch(() => {});
  })
  .catch(() => signedOut());
