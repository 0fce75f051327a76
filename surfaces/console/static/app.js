// The console's router: #/runs, #/run/ID, #/compare/A/B, #/pool, #/ledger[/SEQ].
import { tool } from "./api.js";
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

window.addEventListener("hashchange", route);
route();
tool("health")
  .then((health) => {
    document.getElementById("who").textContent = `tally ${health.version} · ledger ${health.ledger_size}`;
  })
  .catch(() => {});
