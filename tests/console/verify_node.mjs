// Runs the console's verify module (the very file the browser loads) on vectors from stdin and
// prints, per case, whether it passed and the steps it showed.
import { readFileSync } from "node:fs";
import { verifyEntry } from "../../surfaces/console/static/verify.js";

const cases = JSON.parse(readFileSync(0, "utf8"));
const out = [];
for (const c of cases) out.push({ name: c.name, ...(await verifyEntry(c.data)) });
process.stdout.write(JSON.stringify(out));
