// Elements from data: text always goes in as text (everything shown is untrusted input).
export function h(tag, attrs = {}, ...children) {
  const svg = ["svg", "g", "rect", "line", "text", "path", "title"].includes(tag);
  const el = svg
    ? document.createElementNS("http://www.w3.org/2000/svg", tag)
    : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "class") el.setAttribute("class", value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function age(us) {
  if (!us) return "";
  const s = Math.max(0, Math.round((Date.now() * 1000 - us) / 1e6));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h`;
  return `${Math.floor(s / 86400)}d`;
}

export function json(value) {
  return h("pre", { class: "json" }, JSON.stringify(value, null, 2));
}

export function fail(where, err) {
  where.append(h("p", { class: "error" }, String(err.message || err)));
}
