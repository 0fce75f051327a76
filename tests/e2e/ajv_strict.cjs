// Compiles JSON schemas with Ajv's JSON Schema 2020-12 class in strict mode (every strict
// option on: unknown keywords, types, tuples, required) and validates sample instances.
// Input (argv[2]): {"schemas": [{"label", "schema"}], "instances": [{"label", "data"}]}.
// Output (stdout): {"errors": [{"label", "error"}], "verdicts": [true|false|null]}.
"use strict";
const fs = require("node:fs");
const Ajv2020 = require("ajv/dist/2020").default;
const addFormats = require("ajv-formats").default;

const input = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const ajv = new Ajv2020({ strict: true, allErrors: true });
addFormats(ajv);
const compiled = new Map();
const errors = [];
for (const { label, schema } of input.schemas) {
  try {
    compiled.set(label, ajv.compile(schema));
  } catch (err) {
    errors.push({ label, error: String(err.message || err) });
  }
}
const verdicts = (input.instances || []).map(({ label, data }) => {
  const validate = compiled.get(label);
  return validate ? validate(data) : null;
});
process.stdout.write(JSON.stringify({ errors, verdicts }));
