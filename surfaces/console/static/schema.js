// Check an entry's body against its kind's published JSON Schema (GET /v1/record/schema, the
// document `tally ledger schema` prints and `tally ledger verify --deep` checks with). The
// schemas are pydantic's plain JSON Schema 2020-12, so this validates the keywords they use;
// any other keyword is refused rather than ignored, so a schema this cannot read never passes.
// Pure functions over data, so Node runs the same code in the tests.

const ANNOTATIONS = new Set(["$schema", "title", "description", "default", "examples", "$comment"]);
const KEYWORDS = new Set([
  "$ref", "$defs", "type", "enum", "const", "anyOf", "properties", "required",
  "additionalProperties", "items", "minItems", "maxItems",
]);

function typeOf(value) {
  if (value === null) return "null";
  if (Array.isArray(value)) return "array";
  if (typeof value === "number") return Number.isInteger(value) ? "integer" : "number";
  return typeof value;
}

function fits(type, value) {
  const actual = typeOf(value);
  return actual === type || (type === "number" && actual === "integer");
}

function same(a, b) {
  return JSON.stringify(a) === JSON.stringify(b);
}

function check(schema, value, where, root, errors) {
  if (schema === true) return;
  if (schema === false) {
    errors.push(`${where}: nothing is allowed here`);
    return;
  }
  for (const key of Object.keys(schema)) {
    if (!KEYWORDS.has(key) && !ANNOTATIONS.has(key)) throw new Error(`unsupported schema keyword ${key}`);
  }
  if (schema.$ref !== undefined) {
    const m = /^#\/\$defs\/(.+)$/.exec(schema.$ref);
    if (!m || !root.$defs || !(m[1] in root.$defs)) throw new Error(`unresolvable $ref ${schema.$ref}`);
    check(root.$defs[m[1]], value, where, root, errors);
  }
  if (schema.anyOf !== undefined) {
    const fitting = schema.anyOf.some((option) => {
      const found = [];
      check(option, value, where, root, found);
      return found.length === 0;
    });
    if (!fitting) errors.push(`${where}: fits none of its allowed shapes`);
  }
  if (schema.type !== undefined) {
    const types = Array.isArray(schema.type) ? schema.type : [schema.type];
    if (!types.some((t) => fits(t, value))) {
      errors.push(`${where}: is ${typeOf(value)}, not ${types.join(" or ")}`);
      return;
    }
  }
  if (schema.enum !== undefined && !schema.enum.some((v) => same(v, value))) {
    errors.push(`${where}: is not one of ${JSON.stringify(schema.enum)}`);
  }
  if (schema.const !== undefined && !same(schema.const, value)) {
    errors.push(`${where}: is not ${JSON.stringify(schema.const)}`);
  }
  if (typeOf(value) === "object") {
    const props = schema.properties || {};
    for (const name of schema.required || []) {
      if (!(name in value)) errors.push(`${where}: the field ${name} is missing`);
    }
    for (const [name, item] of Object.entries(value)) {
      if (name in props) check(props[name], item, `${where}.${name}`, root, errors);
      else if (schema.additionalProperties !== undefined) {
        check(schema.additionalProperties, item, `${where}.${name}`, root, errors);
      }
    }
  }
  if (typeOf(value) === "array") {
    if (schema.minItems !== undefined && value.length < schema.minItems) errors.push(`${where}: fewer than ${schema.minItems} items`);
    if (schema.maxItems !== undefined && value.length > schema.maxItems) errors.push(`${where}: more than ${schema.maxItems} items`);
    if (schema.items !== undefined) value.forEach((item, i) => check(schema.items, item, `${where}[${i}]`, root, errors));
  }
}

// What in `body` does not fit `schema` (a kind's schema from the published document): a list
// of "<where>: <why>", empty when it fits. Throws on a schema it cannot read.
export function mismatches(schema, body) {
  const errors = [];
  check(schema, body, "$", schema, errors);
  return errors;
}

// The verdict on one entry's body: {ok, detail}. A kind the document does not name is not
// tally's: there is nothing to hold it to.
export function checkBody(published, kind, body) {
  const schema = published.schemas[kind];
  if (schema === undefined) return { ok: null, detail: `${kind} is not a kind tally writes` };
  const errors = mismatches(schema, body);
  if (errors.length) return { ok: false, detail: errors.slice(0, 5).join("; ") };
  return { ok: true, detail: `fits the published schema of ${kind}` };
}
