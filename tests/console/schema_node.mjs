// Runs the console's schema check (the very file the browser loads) on {document, bodies}
// from stdin and prints, per body, its verdict and what does not fit.
import { readFileSync } from "node:fs";
import { checkBody } from "../../surfaces/console/static/schema.js";

const input = JSON.parse(readFileSync(0, "utf8"));
const out = input.bodies.map(({ kind, body }) => checkBody(input.document, kind, body));
process.stdout.write(JSON.stringify(out));
