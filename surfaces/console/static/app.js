// The console's router: #/runs, #/run/ID, #/compare/A/B, #/pool, #/ledger[/SEQ].
import { logout, session, signedOut, tool } from "./api.js";
import { h } from "./dom.js";
import { runsPage } from "./runs.js";
import { runPage } from "./run.js";
import { comparePage } from "./compare.js";
import { poolPage } from "./pool.js";
import { ledgerPage } from "./ledger.js";

let cleanup = () => {};

async function route() {
  cleanup();
  cleanup = () => {};
  const main = document.getElementById("main");
  main.replaceChildren();
  const [page, ...rest] = (location.hash.replace(/^#\/?/, "") || "runs").split("/").map(decodeURIComponent);
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("current", a.id === `nav-${page === "run" ? "runs" : page}`);
  }
  const pages = { runs: runsPage, run: runPage, compare: comparePage, pool: poolPage, ledger: ledgerPage };
  const render = pages[page] || runsPage;
  try {
    cleanup = (await render(main, ...rest)) || (() => {});
  } catch (err) {
    main.append(h("p", { class: "error" }, String(err.message || err)));
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
