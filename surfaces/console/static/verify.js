// Check a ledger entry without trusting the daemon: the entry line's RFC 9162 leaf hash, its
// inclusion proof up to a root, and that root's C2SP signed note (ed25519) against a key the
// user pinned. Pure functions over data (no fetching), so Node runs the same code in the tests.
// Uses only WebCrypto (SHA-256, Ed25519), which browsers and Node >= 20 provide.

const subtle = globalThis.crypto.subtle;
const enc = new TextEncoder();

export function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

export function unhex(text) {
  if (typeof text !== "string" || !/^([0-9a-f]{2})*$/.test(text)) throw new Error("not hex");
  const out = new Uint8Array(text.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(text.slice(2 * i, 2 * i + 2), 16);
  return out;
}

function unbase64(text) {
  if (!/^[A-Za-z0-9+/]*={0,2}$/.test(text)) throw new Error("not base64");
  const raw = atob(text);
  return Uint8Array.from(raw, (c) => c.charCodeAt(0));
}

function concat(...parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

export async function sha256(bytes) {
  return new Uint8Array(await subtle.digest("SHA-256", bytes));
}

export async function leafHash(line) {
  return sha256(concat(Uint8Array.of(0), enc.encode(line)));
}

async function nodeHash(left, right) {
  return sha256(concat(Uint8Array.of(1), left, right));
}

// RFC 9162 section 2.1.3.2: the root an inclusion proof implies for a leaf.
export async function rootFromInclusion(index, size, leaf, path) {
  if (!Number.isSafeInteger(index) || !Number.isSafeInteger(size) || index < 0 || index >= size) {
    throw new Error(`leaf ${index} is not in a tree of ${size}`);
  }
  let fn = index;
  let sn = size - 1;
  let r = leaf;
  for (const p of path) {
    if (sn === 0) throw new Error("the proof is longer than the tree is deep");
    if (fn % 2 === 1 || fn === sn) {
      r = await nodeHash(p, r);
      if (fn % 2 === 0) {
        while (fn % 2 === 0 && fn !== 0) {
          fn = Math.floor(fn / 2);
          sn = Math.floor(sn / 2);
        }
      }
    } else {
      r = await nodeHash(r, p);
    }
    fn = Math.floor(fn / 2);
    sn = Math.floor(sn / 2);
  }
  if (sn !== 0) throw new Error("the proof is shorter than the tree is deep");
  return r;
}

// A C2SP verifier key: name+hexid+base64(0x01 || 32-byte ed25519 key).
export async function parseVkey(vkey) {
  // base64 may itself hold "+": only the first two separate fields (as `split("+", 2)`)
  const m = /^([^+]+)\+([0-9a-f]{8})\+(.+)$/.exec(String(vkey).trim());
  if (!m) throw new Error("a verifier key is name+id+key");
  const [, name, id, b64] = m;
  const raw = unbase64(b64);
  if (raw.length !== 33 || raw[0] !== 1) throw new Error("not an ed25519 verifier key");
  const key = raw.slice(1);
  const expected = hex((await sha256(concat(enc.encode(name + "\n"), raw))).slice(0, 4));
  if (expected !== id) throw new Error("the key id does not match the key");
  return { name, id, key, fingerprint: hex(await sha256(key)) };
}

// A checkpoint note: "origin\nsize\nbase64 root\n[ext lines]\n\n— name base64(id||sig)\n…".
export function parseNote(note) {
  const split = note.indexOf("\n\n");
  if (split < 0) throw new Error("a signed note has a blank line before its signatures");
  const text = note.slice(0, split + 1);
  const lines = text.slice(0, -1).split("\n");
  if (lines.length < 3 || !/^[0-9]+$/.test(lines[1])) throw new Error("not a checkpoint");
  const sigs = note
    .slice(split + 2)
    .split("\n")
    .filter((l) => l.length)
    .map((line) => {
      const m = /^— (\S+) ([A-Za-z0-9+/=]+)$/.exec(line);
      if (!m) throw new Error("a signature line is malformed");
      const raw = unbase64(m[2]);
      return { name: m[1], id: hex(raw.slice(0, 4)), sig: raw.slice(4) };
    });
  return { text, origin: lines[0], size: Number(lines[1]), root: hex(unbase64(lines[2])), sigs };
}

export async function verifyNote(note, vkey) {
  const key = await parseVkey(vkey);
  const parsed = parseNote(note);
  const sig = parsed.sigs.find((s) => s.name === key.name && s.id === key.id);
  if (!sig) throw new Error(`no signature by ${key.name}+${key.id}`);
  const pub = await subtle.importKey("raw", key.key, { name: "Ed25519" }, false, ["verify"]);
  const ok = await subtle.verify({ name: "Ed25519" }, pub, sig.sig, enc.encode(parsed.text));
  if (!ok) throw new Error("the ed25519 signature does not verify");
  return parsed;
}

// The whole check, step by step. `data` = {seq, line, proof: {leaf_index, tree_size, path},
// note, vkey}. Returns {ok, steps: [{step, ok, detail}]}; stops at the first failed step.
export async function verifyEntry(data) {
  const steps = [];
  const step = async (name, fn) => {
    try {
      const detail = await fn();
      steps.push({ step: name, ok: true, detail });
      return true;
    } catch (err) {
      steps.push({ step: name, ok: false, detail: String(err.message || err) });
      return false;
    }
  };
  let note;
  let leaf;
  let root;
  const ok =
    (await step("entry line", () => {
      const entry = JSON.parse(data.line);
      if (entry.seq !== data.seq) throw new Error(`the line is entry ${entry.seq}, not ${data.seq}`);
      return `entry ${entry.seq}: ${entry.kind} by ${entry.actor}`;
    })) &&
    (await step("checkpoint signature (ed25519)", async () => {
      note = await verifyNote(data.note, data.vkey);
      return `tree size ${note.size}, signed by ${note.sigs[0].name}`;
    })) &&
    (await step("leaf hash SHA-256(0x00 || line)", async () => {
      leaf = await leafHash(data.line);
      return hex(leaf);
    })) &&
    (await step("inclusion proof → root", async () => {
      const p = data.proof;
      if (p.leaf_index !== data.seq) throw new Error("the proof is for another entry");
      if (p.tree_size !== note.size) throw new Error("the proof is for another tree size");
      root = await rootFromInclusion(p.leaf_index, p.tree_size, leaf, p.path.map(unhex));
      return hex(root);
    })) &&
    (await step("root equals the signed root", () => {
      if (hex(root) !== note.root) throw new Error(`computed ${hex(root)}, signed ${note.root}`);
      return note.root;
    }));
  return { ok, steps };
}
